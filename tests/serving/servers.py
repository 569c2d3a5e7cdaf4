"""A real tritonserver on loopback serving a tiny-model engine (word tokenizer), started and stopped by PID."""

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.runtime import Engine
from export.tiny_engine import export_tiny_engine, word_tokenizer, words
from hf.conftest import tiny_model

MODEL = "criticalkv"


def random_words(n, seed):
    """A prompt of n words of the tiny vocabulary (ids 2..127: no [UNK], no </s>) and its token ids."""
    ids = torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return words(ids), ids


def build_tiny_engine(folder: Path, **limits) -> Path:
    policy = KVPolicy("criticalkv", budget=40, window=8)
    model = tiny_model("llama", seed=4)
    # long generations (the slot tests): RoPE takes any position, the config's limit is only checked
    model.config.max_position_embeddings = max(1024, limits.get("max_input_len", 256) + limits.get("max_new_tokens", 32))
    return export_tiny_engine(model, policy, folder, tokenizer=word_tokenizer(), **limits)


class Served:
    """A running server and the same engine loaded in the test process (the reference)."""

    def __init__(self, server, engine):
        self.server, self.engine = server, engine
        self.url = f"{server.http_url}/v2/models/{MODEL}"

    def expected_text(self, ids, max_tokens):
        tokens = self.engine.generate([ids], max_new_tokens=max_tokens).tokens[0]
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=True)

    def generate_and_stream(self, text, max_tokens):
        """((status, answer) of /generate with the KV bytes, (status, events) of /generate_stream) for one prompt."""
        common = {"text_input": text, "max_tokens": max_tokens, "ignore_eos": True, "exclude_input_in_output": True}
        return (self.post("generate", {**common, "return_kv_bytes": True}),
                self.post("generate_stream", {**common, "stream": True}))

    def ask_after_context_twice(self, context_ids, question_ids, max_tokens):
        """[(status, answer)] of the same question after the same context, sent twice (a miss, then the context
        cache's hit)."""
        return [self.post("generate", {"input_ids": question_ids, "context_ids": context_ids, "max_tokens": max_tokens,
                                       "ignore_eos": True, "exclude_input_in_output": True}) for _ in range(2)]

    def post(self, endpoint, body, timeout=120):
        """(status, parsed JSON or SSE events) of POST /v2/models/criticalkv/<endpoint>."""
        request = urllib.request.Request(f"{self.url}/{endpoint}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode()
                status = response.status
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read().decode())
        if endpoint == "generate_stream":
            return status, [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
        return status, json.loads(text)


def start_server(tmp_path_factory, instances=1, max_num_seqs=None, backend=None, **limits):
    from criticalkv.serving import launcher
    from criticalkv.serving.repository import make_repository
    from criticalkv.serving.scheduler import SchedulerConfig

    if not launcher.is_set_up():
        pytest.fail("tritonserver is not set up: run `criticalkv serve --setup` (scripts/install.sh does)")
    engine_dir = build_tiny_engine(tmp_path_factory.mktemp("engine"), **limits)
    repo = tmp_path_factory.mktemp("repo")
    make_repository(engine_dir, repo, model_name=MODEL, instances=instances,
                    # exact context copies: the tests compare served answers with the engine's own tokens
                    scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, context_cache_dtype="float32"), threads=1,
                    execution_env=str(launcher.model_env()), python_paths=launcher.project_paths(), force=True,
                    backend=backend)
    server = launcher.TritonServer(repo, log_file=repo / "tritonserver.log")
    server.start(timeout_s=240)
    return server, Engine.load(engine_dir, threads=1, **({} if backend is None else {"backend": backend}))


def stop_server(server, engine):
    pid = server.process.pid
    code = server.stop()
    engine.close()
    assert code is not None, "tritonserver did not exit"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the PID is gone (reaped)
