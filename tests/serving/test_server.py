"""The Triton model served for real (tritonserver on loopback, 2 instances) on a tiny-model engine:
every protocol gives the text of Engine.generate, streaming, concurrency, bad requests."""

import json
import os
import queue
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from serving.servers import MODEL, random_words, start_server, stop_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from serving.servers import Served

    # started from a directory holding another `criticalkv` (as from another checkout): the model still imports the
    # project's own (a stub's sys.path begins with its working directory)
    shadow = tmp_path_factory.mktemp("cwd")
    (shadow / "criticalkv").mkdir()
    (shadow / "criticalkv" / "__init__.py").write_text("raise ImportError(\"a working directory's criticalkv\")\n")
    here = os.getcwd()
    os.chdir(shadow)
    try:
        server, engine = start_server(tmp_path_factory, instances=2, max_batch_size=4)
    finally:
        os.chdir(here)
    yield Served(server, engine)
    stop_server(server, engine)


def grpc_stream(served, text, sampling, stream=True, extra=()):
    """Every response of one request over gRPC streaming: [(text_output, is_final, response)]."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(served.server.grpc_url)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    sampling = np.array([json.dumps(sampling).encode()], dtype=object)
    for name, dtype, value in [("text_input", "BYTES", np.array([text.encode()], dtype=object)),
                               ("stream", "BOOL", np.array([stream])),
                               ("sampling_parameters", "BYTES", sampling), *extra]:
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.async_stream_infer(MODEL, inputs, request_id="1", enable_empty_final_response=True)
    responses = []
    while True:
        result, error = results.get(timeout=120)
        if error is not None:
            client.stop_stream()
            raise error
        final = result.get_response().parameters["triton_final_response"].bool_param
        out = result.as_numpy("text_output")
        responses.append(("" if out is None else b"".join(out).decode(), final, result))
        if final:
            break
    client.stop_stream()
    client.close()
    return responses


def test_every_protocol_gives_the_text_of_engine_generate(served):
    text, ids = random_words(150, seed=1)
    expected = served.expected_text(ids, 20)
    assert expected  # 20 words
    body = {"text_input": text, "sampling_parameters": json.dumps({"max_tokens": 20})}
    status, out = served.post("generate", {**body, "exclude_input_in_output": True})
    assert status == 200 and out["text_output"] == expected and out["finish_reason"] == "length"
    status, out = served.post("generate", body)  # vllm_backend's default: the prompt, then the output
    assert out["text_output"] == text + expected
    status, events = served.post("generate_stream", {**body, "stream": True})
    assert status == 200 and "".join(e["text_output"] for e in events) == expected
    responses = grpc_stream(served, text, {"max_tokens": 20})
    assert "".join(r[0] for r in responses) == expected
    # streaming: one response per token (20), only the last one flagged final
    assert len(responses) == 20 and [r[1] for r in responses] == [False] * 19 + [True]
    last = responses[-1][2]
    assert last.as_numpy("finish_reason")[0] == b"length"
    one = grpc_stream(served, text, {"max_tokens": 20}, stream=False,
                      extra=[("exclude_input_in_output", "BOOL", np.array([True]))])
    assert [(r[0], r[1]) for r in one] == [(expected, True)]


def test_streaming_counts_and_kv_bytes(served):
    text, ids = random_words(120, seed=2)
    status, events = served.post("generate_stream", {
        "text_input": text, "stream": True, "max_tokens": 6, "return_num_output_tokens": True,
        "return_num_input_tokens": True, "return_kv_bytes": True})
    assert status == 200 and len(events) == 6
    assert [e["num_output_tokens"] for e in events] == [1] * 6
    last = events[-1]
    assert last["num_input_tokens"] == 120 and last["finish_reason"] == "length"
    full = 120 * 2 * 3 * 2 * 16 * 4  # tokens x KV heads x layers x (K, V) x head_dim x fp32
    assert last["kv_bytes_full"] == full and 0 < last["kv_bytes_kept"] <= 40 * 2 * 3 * 2 * 16 * 4
    assert "".join(e["text_output"] for e in events) == served.expected_text(ids, 6)


def test_concurrent_clients_get_the_text_served_alone(served):
    # 8 clients x 10 requests, prompts of 20..250 words and max_tokens 1..32, through 2 instances x 4 slots
    jobs = []
    for client in range(8):
        for k in range(10):
            seed = 100 + 10 * client + k
            n = 20 + (37 * seed) % 231
            jobs.append((client, seed, n, 1 + (13 * seed) % 32))
    expected = {}
    for _, seed, n, m in jobs:
        expected[seed] = served.expected_text(random_words(n, seed)[1], m)

    def client_run(client):
        got = {}
        for c, seed, n, m in jobs:
            if c == client:
                status, out = served.post("generate", {"text_input": random_words(n, seed)[0], "max_tokens": m,
                                                       "exclude_input_in_output": True})
                got[seed] = (status, out.get("text_output", out))
        return got

    with ThreadPoolExecutor(8) as pool:
        results = {}
        for part in pool.map(client_run, range(8)):
            results.update(part)
    errors = {seed: r for seed, r in results.items() if r[0] != 200}
    assert not errors
    assert {seed: r[1] for seed, r in results.items()} == expected
    # both instances served (each has its own engine and scheduler and reports its own metrics)
    metrics = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    counts = re.findall(r'criticalkv_time_to_first_token_seconds_count\{[^}]*instance="([^"]+)"[^}]*\} (\d+)', metrics)
    assert len(counts) == 2 and all(int(c) > 0 for _, c in counts), counts


BAD_REQUESTS = [
    ({}, "text_input"),
    ({"text_input": "w5 w6", "sampling_parameters": "{max_tokens: 3"}, "sampling_parameters: malformed JSON"),
    ({"text_input": "w5 w6", "sampling_parameters": "[1, 2]"}, "sampling_parameters: expected a JSON object"),
    ({"text_input": "w5 w6", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"text_input": "w5 w6", "max_tokens": 33}, r"max_tokens must lie in \[1, 32\]"),
    ({"text_input": "w5 w6", "sampling_parameters": json.dumps({"temperature": -1})}, "temperature"),
    ({"text_input": "w5 w6", "sampling_parameters": json.dumps({"max_tokens": 4, "colour": 1})}, "unknown key.*colour"),
    ({"text_input": " ".join(["w5"] * 257)}, "257 tokens, more than the engine's max input length 256"),
    ({"text_input": ""}, "prompt is empty"),
    ({"text_input": "w5 w6", "kv_budget": 41}, r"kv_budget must lie in \[8, 40\]"),
    ({"text_input": "w5 w6", "kv_budget": 7}, r"kv_budget must lie in \[8, 40\]"),
    ({"text_input": "w5 w6", "stream": True, "exclude_input_in_output": False}, "exclude_input_in_output"),
]


@pytest.mark.parametrize("body,message", BAD_REQUESTS, ids=[m.split(":")[0][:30] for _, m in BAD_REQUESTS])
def test_a_bad_request_gets_an_error_naming_the_problem(served, body, message):
    status, out = served.post("generate", body)
    assert status == 400 and re.search(message, out["error"]), out
    text, ids = random_words(30, seed=3)  # the server keeps serving
    status, out = served.post("generate", {"text_input": text, "max_tokens": 3, "exclude_input_in_output": True})
    assert status == 200 and out["text_output"] == served.expected_text(ids, 3)


def test_kv_budget_per_request(served):
    text, ids = random_words(200, seed=8)
    body = {"text_input": text, "max_tokens": 4, "return_kv_bytes": True, "exclude_input_in_output": True}
    status, built = served.post("generate", {**body, "kv_budget": 40})  # the built budget: always accepted
    assert status == 200 and built["text_output"] == served.expected_text(ids, 4)
    status, out = served.post("generate", {**body, "kv_budget": 20})
    if served.engine.backend.accepts_kv_budget:  # a prefill graph with the budget as an input keeps less
        assert status == 200 and out["kv_bytes_kept"] < built["kv_bytes_kept"]
    else:
        assert status == 400 and "built without a runtime budget input; rebuild it" in out["error"]


def test_wrong_dtype_is_refused_over_grpc(served):
    # (Triton checks dtypes against config.pbtxt before the model sees the request; its generate endpoint
    # answers a JSON value of the wrong type with a parse error that does not name the input)
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(served.server.grpc_url)
    errors = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    tensor = grpcclient.InferInput("text_input", [1], "INT32")
    tensor.set_data_from_numpy(np.array([5], np.int32))
    client.async_stream_infer(MODEL, [tensor])
    error = errors.get(timeout=60)
    client.stop_stream()
    assert isinstance(error, InferenceServerException) and "text_input" in str(error) and "INT32" in str(error)


def test_model_config_has_the_vllm_backend_names_and_two_instances(served):
    config = json.loads(urllib.request.urlopen(f"{served.url}/config", timeout=10).read())
    assert config["model_transaction_policy"]["decoupled"] is True
    assert [i["name"] for i in config["input"]] == [
        "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "kv_budget",
        "return_num_input_tokens", "return_num_output_tokens", "return_kv_bytes", "apply_chat_template",
        "context", "input_ids", "context_ids", "context_threshold"]
    assert [o["name"] for o in config["output"]] == [
        "text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "kv_bytes_kept", "kv_bytes_full",
        "context_cache_hit"]
    assert config["instance_group"][0]["count"] == 2 and config["instance_group"][0]["kind"] == "KIND_CPU"
    # what it serves, which a benchmark pointed at the server (--url) reads instead of being told
    from criticalkv.bench.served import served_engine
    from criticalkv.policy import policy_spec

    policy = served.engine.policy
    assert config["parameters"]["criticalkv_policy"]["string_value"] == policy_spec(policy)
    described = served_engine(served.server.http_url, MODEL)
    assert (described["policy"], described["budget"]) == (policy.name, policy.budget)
    assert described["label"] == f"{policy_spec(policy)} b={policy.budget}"
    assert described["backend"] == served.engine.backend.name == "onnxruntime"  # the repository's default


def test_a_context_input_is_cached_across_requests(served):
    # Triton's generate endpoint with `context` (the document) and `text_input` (the question after it): later requests
    # on the same context restore its compressed entries (context_cache_hit) and answer the same way. Each of the two
    # model instances keeps its own cache: at most one miss per instance
    doc, doc_ids = random_words(160, seed=31)
    outs = []
    for seed in (32, 33, 32, 33, 32):
        question, question_ids = random_words(5, seed=seed)
        status, out = served.post("generate", {"text_input": question, "context": doc, "max_tokens": 4,
                                               "exclude_input_in_output": True})
        assert status == 200, out
        tokens = served.engine.generate([doc_ids], 4, questions=[question_ids]).tokens[0]
        assert out["text_output"] == served.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        outs.append(out)
    hits = [o["context_cache_hit"] for o in outs]
    assert hits[0] is False and hits.count(False) <= 2 and hits.count(True) >= 3, hits
    assert outs[2]["text_output"] == outs[0]["text_output"]  # a hit answers as the cold request did
