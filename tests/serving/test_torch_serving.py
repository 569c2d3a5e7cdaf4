"""The Triton model on the torch backend, served for real (the bundled tritonserver, CPU): an engine directory built
with ``--backend torch`` is rendered with its own backend, and the model (in the server's model environment, which
reaches the project's torch and transformers) gives the text of the same engine loaded here."""

import json

import pytest

from criticalkv import KVPolicy
from criticalkv.export import BuildConfig
from export.tiny_engine import save_tiny_checkpoint
from serving.servers import MODEL, Served, random_words


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from criticalkv.build import build_engine
    from criticalkv.runtime import Engine
    from criticalkv.serving import launcher
    from criticalkv.serving.repository import make_repository
    from criticalkv.serving.scheduler import SchedulerConfig

    if not launcher.is_set_up():
        pytest.fail("tritonserver is not set up: run `criticalkv serve --setup` (scripts/install.sh does)")
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny", seed=4)
    engine_dir = build_engine(tmp_path_factory.mktemp("engines") / "tiny-torch", KVPolicy("criticalkv", budget=40, window=8),
                              BuildConfig(max_input_len=256, max_new_tokens=32, max_batch_size=2, dtype="float32"),
                              model=str(checkpoint), backend="torch", smoke=False, log=lambda message: None)
    repo = tmp_path_factory.mktemp("repo")
    # exact context copies: a context request must equal the ONNX Runtime engine's tokens
    target = make_repository(engine_dir, repo, model_name=MODEL, threads=1, execution_env=str(launcher.model_env()),
                             scheduler=SchedulerConfig(context_cache_dtype="float32"),
                             python_paths=launcher.project_paths(), force=True)  # no backend named: the directory's
    assert json.loads((target / "1" / "model.json").read_text())["backend"] == "torch"
    assert "kind: KIND_CPU" in (target / "config.pbtxt").read_text()
    server = launcher.TritonServer(repo, log_file=repo / "tritonserver.log")
    server.start(timeout_s=240)
    engine = Engine.load(engine_dir, threads=1)
    # the same checkpoint, policy and limits built for ONNX Runtime: what a context request must equal
    onnx_dir = build_engine(tmp_path_factory.mktemp("engines") / "tiny-onnx", KVPolicy("criticalkv", budget=40, window=8),
                            BuildConfig(max_input_len=256, max_new_tokens=32, max_batch_size=2, dtype="float32"),
                            model=str(checkpoint), smoke=False, log=lambda message: None)
    served = Served(server, engine)
    served.onnx_engine = Engine.load(onnx_dir, backend="onnxruntime", threads=1)
    yield served
    server.stop()
    engine.close()
    served.onnx_engine.close()


def test_the_served_torch_engine_gives_the_text_of_engine_generate(served):
    text, ids = random_words(120, seed=3)
    expected = served.expected_text(ids, 12)
    assert expected
    (status, out), (stream_status, events) = served.generate_and_stream(text, 12)
    assert status == 200 and out["text_output"] == expected
    assert 0 < out["kv_bytes_kept"] < out["kv_bytes_full"]
    assert stream_status == 200 and "".join(e["text_output"] for e in events) == expected
    status, out = served.post("generate", {"text_input": text, "max_tokens": 4, "kv_budget": 16})
    assert status == 200 and out["text_output"]
    status, out = served.post("generate", {"text_input": text, "max_tokens": 4, "kv_budget": 41})
    assert status == 400 and "kv_budget" in out["error"]


def test_a_context_served_on_torch_answers_as_the_onnx_runtime_engine(served):
    """A question after a context (compressed question-agnostically by the engine's context policy, then cached): the
    torch backend behind the server answers with ONNX Runtime's tokens for the same checkpoint, twice (the second from
    the context cache)."""
    _, context = random_words(150, seed=5)
    _, question = random_words(9, seed=6)
    onnx = served.onnx_engine
    assert onnx.context_policy is not None and onnx.context_policy == served.engine.context_policy
    tokens = onnx.generate([context], 8, stop_token_ids=[], questions=[question]).tokens[0]
    expected = onnx.tokenizer.decode(tokens, skip_special_tokens=True)
    assert expected
    answers = served.ask_after_context_twice(context, question, 8)
    assert all(status == 200 and out["text_output"] == expected for status, out in answers)
    assert [out["context_cache_hit"] for _, out in answers] == [False, True]
