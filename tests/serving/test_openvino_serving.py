"""The Triton model on the OpenVINO backend, served for real (the bundled tritonserver, CPU): `serve --backend openvino`
renders the repository for it, and the model gives the text of the same engine loaded here on OpenVINO (the CPU
plugin's default precision on both sides), for a prompt, its stream, and a question after a cached context."""

import json
import os

import pytest

from serving.servers import Served, random_words, start_server, stop_server

pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    previous = os.environ.get("CRITICALKV_OV_CACHE")
    os.environ["CRITICALKV_OV_CACHE"] = ""  # no compiled-model cache outside the test's folders (the server inherits it)
    try:
        server, engine = start_server(tmp_path_factory, backend="openvino")
        yield Served(server, engine)
        stop_server(server, engine)
    finally:
        if previous is None:
            os.environ.pop("CRITICALKV_OV_CACHE", None)
        else:
            os.environ["CRITICALKV_OV_CACHE"] = previous


def test_the_served_openvino_engine_gives_the_text_of_engine_generate(served):
    assert served.engine.backend.name == "openvino"
    model = json.loads((served.server.repo / "criticalkv" / "1" / "model.json").read_text())
    assert model["backend"] == "openvino"  # what the served model loads
    text, ids = random_words(120, seed=3)
    expected = served.expected_text(ids, 12)
    assert expected
    (status, out), (stream_status, events) = served.generate_and_stream(text, 12)
    assert status == 200 and out["text_output"] == expected
    assert 0 < out["kv_bytes_kept"] < out["kv_bytes_full"]
    assert stream_status == 200 and "".join(e["text_output"] for e in events) == expected


def test_a_context_on_openvino_is_compressed_once_and_answers_from_the_cache(served):
    _, context = random_words(150, seed=5)
    _, question = random_words(9, seed=6)
    engine = served.engine
    tokens = engine.generate([context], 8, stop_token_ids=[], questions=[question]).tokens[0]
    expected = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    answers = served.ask_after_context_twice(context, question, 8)
    assert all(status == 200 and out["text_output"] == expected for status, out in answers)
    assert [out["context_cache_hit"] for _, out in answers] == [False, True]
