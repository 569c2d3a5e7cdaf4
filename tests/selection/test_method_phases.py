"""A method that changes the pipeline, added in one module and one registry line: the engine, the exporter and every
backend run its phases (``criticalkv.methods.phases``) without knowing it.

The method below is what a module of ``criticalkv/methods`` would hold: ``probe`` scores a context question-agnostically
by the attention its entries receive from a fixed question asked after it (one re-read pass of a few tokens, much
cheaper than KVzip's re-read of the whole context), with KVzip's selection pieces (scores given apart, AdaKV's sharing,
the sinks). Nothing else of the package changes: ``register`` is its one registry line.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from criticalkv import KVPolicy
from criticalkv.methods import Method, register, unregister
from criticalkv.methods.kvzip import KVzip
from criticalkv.methods.phases import PromptScoring, RereadPass
from criticalkv.runtime import Engine, Request
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model

# ---------------------------------------------------------------------------------------------- the method's module
#: The question's token ids (a real method would take them from the engine's tokenizer in ``engine_data``).
QUESTION = (5, 17, 33, 2, 61, 9)


class ProbeScoring(PromptScoring):
    """One re-read pass: the question over the whole context, every entry scored."""

    def __init__(self, question):
        self.question = tuple(question)

    def passes(self, ids):
        return [RereadPass(self.question, sinks=0, start=0, end=len(ids))]

    def finish(self, ids, streams, reread):
        return reread


class Probe(KVzip):
    name = "probe"
    description = "question-agnostic: the attention an entry receives from a generic question asked after the context"
    data_key = "probe"

    def streams(self, policy, model):
        return ()

    def rereads(self, policy):
        return True

    def engine_data(self, policy, model, tokenizer=None):
        return {"question": list(QUESTION)}

    def prompt_scoring(self, policy, data, streams):
        return ProbeScoring(data["question"])


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def probe():
    register(Method("probe", Probe(), description=Probe.description))  # the one registry line
    yield KVPolicy("probe", budget=40, window=8)
    unregister("probe")


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def layer0_oracle(model, context):
    """The question's score of every context entry at layer 0, from the model's own modules in float64: the question's
    queries (positions n, n + 1, ...) over the context's keys and the question's own (causal), the largest softmax
    value per entry over the question's tokens and each KV head's query heads."""
    m = model.double()
    try:
        ids = torch.tensor([list(context) + list(QUESTION)])
        attn = m.model.layers[0].self_attn
        h = m.model.layers[0].input_layernorm(m.model.embed_tokens(ids))
        cos, sin = m.model.rotary_emb(h, torch.arange(ids.shape[1])[None])
        heads, kv_heads, d = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
        q = attn.q_proj(h).view(1, -1, heads, d).transpose(1, 2)
        k = attn.k_proj(h).view(1, -1, kv_heads, d).transpose(1, 2)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        n, r = len(context), len(QUESTION)
        k = k.repeat_interleave(heads // kv_heads, 1)
        logits = q[:, :, n:] @ k.transpose(-1, -2) * attn.scaling  # [1, H, r, n + r]
        causal = torch.arange(n + r)[None, :] > (n + torch.arange(r))[:, None]
        probs = F.softmax(logits.masked_fill(causal, -torch.inf), dim=-1)[..., :n]  # [1, H, r, n]
        return probs.amax(dim=2).view(1, kv_heads, -1, n).amax(dim=2).float().numpy()
    finally:
        model.float()


def test_a_method_of_one_module_runs_its_re_read_on_every_backend(probe, tmp_path):
    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, probe, tmp_path / "e", extend_chunk=32, max_question_len=24)
    assert (folder / "reread.onnx").is_file()  # the exporter wrote the re-read graph the method asked for
    context = prompt(150, seed=7)
    got = {}
    for backend in ("onnxruntime", "torch"):
        engine = Engine.load(folder, backend=backend, model=model) if backend == "torch" else Engine.load(folder)
        try:
            assert engine.method_data == {"probe": {"question": list(QUESTION)}}
            job = engine.begin_prefill(Request(context), context=True)
            engine.prefill_step(job, job.remaining)
            scores = engine._score(job)
            np.testing.assert_allclose(scores[0], layer0_oracle(model, context), rtol=2e-5, atol=1e-6)
            result = engine.finish_prefill(job, 0)
            engine.release(0)
            out = engine.generate([context], max_new_tokens=5, stop_token_ids=[], questions=[prompt(7, seed=8)])
            got[backend] = ([k.tolist() for k in result.kept_indices], out.tokens, [s.tolist() for s in scores])
        finally:
            engine.release_all()
            engine.close()
    assert got["torch"][:2] == got["onnxruntime"][:2]
    np.testing.assert_allclose(np.array(got["torch"][2]), np.array(got["onnxruntime"][2]), rtol=1e-4, atol=1e-6)
    # the selection is the method's own over those scores: fewer entries than the context, the sinks kept
    kept = got["onnxruntime"][0]
    assert all(0 in head for layer in kept for head in layer) and sum(len([i for i in h if i >= 0])
                                                                      for layer in kept for h in layer) < 150 * 3 * 2
