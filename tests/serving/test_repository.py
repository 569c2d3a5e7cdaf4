"""The model repository renderer and the request parsing / detokenization of the Triton model (no server)."""

import json

import numpy as np
import pytest

from criticalkv.serving.repository import TEMPLATES, make_repository, render, template_keys
from criticalkv.serving.requests import TextStream, parse_request
from criticalkv.serving.scheduler import RequestError, SchedulerConfig
from export.tiny_engine import word_tokenizer
from serving.servers import build_tiny_engine


def test_render_fills_every_key_and_refuses_missing_or_unknown_ones():
    text = "name: ${name}\ncount: $count\ncost: $$5\n"
    assert template_keys(text) == {"name", "count"}
    assert render(text, {"name": "m", "count": 2}) == "name: m\ncount: 2\ncost: $5\n"
    with pytest.raises(KeyError, match="not filled: count"):
        render(text, {"name": "m"})
    with pytest.raises(KeyError, match="does not have: colour"):
        render(text, {"name": "m", "count": 2, "colour": 1})
    assert template_keys((TEMPLATES / "config.pbtxt").read_text()) == {
        "model_name", "instances", "instance_kind", "gpus", "execution_env_parameter", "policy", "budget", "tokenizer",
        "backend"}


def test_make_repository_writes_the_three_files(tmp_path):
    engine = build_tiny_engine(tmp_path / "engine", max_batch_size=4)
    model = make_repository(engine, tmp_path / "repo", model_name="tiny", instances=2,
                            scheduler=SchedulerConfig(max_num_seqs=3, kv_memory_mib=64, prefill_chunk=256),
                            execution_env=str(tmp_path / "env"), python_paths=["/x"])
    config = (model / "config.pbtxt").read_text()
    assert 'name: "tiny"' in config and 'backend: "python"' in config and "decoupled: true" in config
    assert "count: 2, kind: KIND_CPU" in config and "EXECUTION_ENV_PATH" in config and "$" not in config
    # the backend the model runs on, for a benchmark that reads the config (the engine's default here: ONNX Runtime)
    assert 'key: "criticalkv_backend", value: { string_value: "onnxruntime" }' in config
    arguments = json.loads((model / "1" / "model.json").read_text())
    assert arguments["engine_dir"] == str(engine.resolve()) and arguments["scheduler"]["max_num_seqs"] == 3
    assert arguments["scheduler"]["kv_memory_mib"] == 64 and arguments["python_paths"] == ["/x"]
    assert arguments["scheduler"]["prefill_chunk"] == 256 and arguments["scheduler"]["context_cache_mib"] == 256
    assert make_repository(engine, tmp_path / "defaults").joinpath("1", "model.json").read_text().count('"max_num_seqs": 4')
    assert (model / "1" / "model.py").read_text() == (TEMPLATES / "model.py").read_text()
    gpu = make_repository(engine, tmp_path / "gpu", backend="tensorrt", gpus=[0, 1])
    assert "kind: KIND_GPU, gpus: [ 0, 1 ]" in (gpu / "config.pbtxt").read_text()
    assert "EXECUTION_ENV_PATH" not in (gpu / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="rebuild the engine with --max-batch-size 5"):
        make_repository(engine, tmp_path / "repo2", scheduler=SchedulerConfig(max_num_seqs=5))
    for bad, message in [(dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
                         (dict(kv_memory_mib=0), "kv_memory_mib must be > 0"),
                         (dict(prefill_chunk=-1), "prefill_chunk must be an integer >= 0"),
                         (dict(context_cache_mib=-1), "context_cache_mib must be >= 0"),
                         (dict(context_cache_dtype="bfloat16"), "context_cache_dtype: .*one of float32, float16")]:
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**bad)
    with pytest.raises(ValueError, match="exists"):
        make_repository(engine, tmp_path / "repo", model_name="tiny")
    # the command line writes it too, starting nothing (serve --write-repo; scripts/make_triton_repo.py)
    from criticalkv.cli import main

    assert main(["serve", "--engine-dir", str(engine), "--write-repo", str(tmp_path / "cli"), "--model-name", "cli",
                 "--max-num-seqs", "2", "--execution-env", "none", "--context-cache-dtype", "float32"]) == 0
    written = tmp_path / "cli" / "cli"
    scheduler = json.loads((written / "1" / "model.json").read_text())["scheduler"]
    assert scheduler["max_num_seqs"] == 2 and scheduler["context_cache_dtype"] == "float32"
    assert arguments["scheduler"]["context_cache_dtype"] == "float16"  # the default
    assert 'key: "criticalkv_policy"' in (written / "config.pbtxt").read_text()
    assert "EXECUTION_ENV_PATH" not in (written / "config.pbtxt").read_text()
    assert main(["serve", "--write-repo", str(tmp_path / "cli2")]) == 2  # no --engine-dir: one line, nothing written
    assert not (tmp_path / "cli2").exists()


def b(text):
    return np.array([text.encode()], dtype=object)


def test_parse_request_follows_vllm_backend():
    r = parse_request({"text_input": b("hi"), "sampling_parameters": b(json.dumps(
        {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "w9"}))})
    assert (r.prompt, r.stream, r.prepend_input, r.max_tokens, r.stop) == ("hi", False, True, 7, ["w9"])
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.seed) == (0.5, 0.9, 3)
    r = parse_request({"text_input": b("hi"), "stream": np.array([True]), "kv_budget": np.array([64], np.int32)},
                      parameters=json.dumps({"max_tokens": 5, "something_else": 1}))
    assert (r.stream, r.prepend_input, r.max_tokens, r.kv_budget) == (True, False, 5, 64)
    for inputs, message in [
        ({}, "missing required input 'text_input'"),
        ({"text_input": b("x"), "sampling_parameters": b("{")}, "malformed JSON"),
        ({"text_input": b("x"), "sampling_parameters": b('{"max_tokens": -2}')}, "max_tokens must be >= 1"),
        ({"text_input": b("x"), "sampling_parameters": b('{"max_tokens": 2.5}')}, "max_tokens must be an integer"),
        ({"text_input": b("x"), "sampling_parameters": b('{"top_p": 0}')}, "top_p"),
        ({"text_input": b("x"), "sampling_parameters": b('{"stop": [1]}')}, "stop must be"),
        ({"text_input": b("x"), "stream": np.array([True]), "exclude_input_in_output": np.array([False])},
         "not allowed when streaming"),
    ]:
        with pytest.raises(RequestError, match=message):
            parse_request(inputs)


def test_text_stream_deltas_add_up_and_stop_strings_cut():
    tokenizer = word_tokenizer()
    ids = tokenizer("the quick w40 w41 w42 w43")["input_ids"]
    stream = TextStream(tokenizer)
    deltas = [stream.add([i], final=k == len(ids) - 1)[0] for k, i in enumerate(ids)]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    stream = TextStream(tokenizer, stop=["w42"])
    out, stopped = "", False
    for i in ids:
        delta, stopped = stream.add([i])
        out += delta
        if stopped:
            break
    assert stopped and "w42" not in out and out.rstrip().endswith("w41")


@pytest.fixture(scope="module")
def bundled_tokenizer():
    """The bundled SmolLM2 tokenizer (byte-level BPE: one CJK character spans several tokens)."""
    from transformers import AutoTokenizer

    from criticalkv.hf.loading import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


def test_text_stream_never_sends_a_broken_character(bundled_tokenizer):
    tokenizer = bundled_tokenizer
    text = "Price: 5 € for 日本語 ok"
    ids = tokenizer(text)["input_ids"]
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "no token boundary inside a character: the test would prove nothing"
    # token by token to the end: each held byte is sent once its character completes
    stream = TextStream(tokenizer)
    deltas = [stream.add([i], final=k == len(ids) - 1)[0] for k, i in enumerate(ids)]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    for cut in cuts:  # max_tokens ends the stream inside a character: its bytes are dropped, never U+FFFD
        stream = TextStream(tokenizer)
        deltas = [stream.add([i], final=k == cut - 1)[0] for k, i in enumerate(ids[:cut])]
        sent = "".join(deltas)
        assert "\ufffd" not in sent and sent == tokenizer.decode(ids[:cut]).rstrip("\ufffd") == stream.text
        assert text.startswith(sent)
    # a stop string: the text ends before it
    stream = TextStream(tokenizer, stop=["ok"])
    out = "".join(stream.add([i])[0] for i in ids)
    assert stream.stopped and out == "Price: 5 € for 日本語 "


def test_chat_prompt_text_tokenizes_back_to_the_template_ids(bundled_tokenizer):
    from tokenizers import processors

    from criticalkv.chat import chat_input_ids, chat_prompt_text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "w5 w6 €"},
                {"role": "assistant", "content": "w7"}, {"role": "user", "content": "and?"}]
    text = chat_prompt_text(bundled_tokenizer, messages)
    assert bundled_tokenizer(text)["input_ids"] == chat_input_ids(bundled_tokenizer, messages)
    assert text.endswith("<|im_start|>assistant\n")
    # a tokenizer that adds its BOS itself to a template that writes it too (as Llama's): the text leaves it out
    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    ids = chat_input_ids(tokenizer, messages[1:2])
    assert ids[0] == bos and ids[1] != bos
    text = chat_prompt_text(tokenizer, messages[1:2])
    assert not text.startswith("<s>") and tokenizer(text)["input_ids"] == ids
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt_text(tokenizer, messages)


@pytest.mark.parametrize("chat", [False, True])
def test_encode_inputs_returns_the_question_then_the_context(chat):
    # (prompt ids, context ids) in both forms: the chat form once came back as (context, question)
    from criticalkv.chat import encode_context_question, encode_text
    from criticalkv.serving.requests import TextRequest, encode_inputs
    from eval.conftest import tiny_tokenizer

    tok = tiny_tokenizer()
    document, question = "The play was first printed in 1623. " * 8, "When was it printed?"
    ids, context_ids = encode_inputs(TextRequest(prompt=question, context=document, apply_chat_template=chat), tok)
    if chat:
        assert (context_ids, ids) == tuple(encode_context_question(tok, document, question, chat=True))
        assert len(context_ids) > len(ids)  # the document is the long part
    else:
        assert context_ids == encode_text(tok, document) and ids == encode_text(tok, question, special=False)
