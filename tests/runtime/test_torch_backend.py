"""The torch backend's own contract: engine directories built with ``--backend torch`` (a manifest naming the
checkpoint, no ONNX), what it refuses, and on a GPU its CUDA graphs.

Its tokens and kept entries against ONNX Runtime and the PyTorch path are tested where the other backends' are:
tests/runtime/test_model_families.py (every architecture), test_engine_extend.py (every policy: chunked prefill, a
question after a context), test_engine_slots.py and tests/serving/test_scheduler.py (slots, the scheduler), and
test_bundled_parity.py (the bundled model, every policy, slow).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.build import build_engine
from criticalkv.export import BuildConfig
from criticalkv.methods import SURROGATE_FALLBACK
from criticalkv.policy import parse_policy_spec
from criticalkv.node import node_capacity
from criticalkv.runtime import Engine, EngineError, Request
from criticalkv.runtime.manifest import read_manifest
from export.tiny_engine import export_tiny_engine, save_tiny_checkpoint
from hf.conftest import tiny_model
from policies import POLICY_CASES, make_policy

ROOT = Path(__file__).resolve().parents[2]
POLICY = KVPolicy("ada-criticalkv", budget=40, window=8)
LIMITS = BuildConfig(max_input_len=160, max_new_tokens=8, max_batch_size=2, max_question_len=16, dtype="float32")


def prompt(n, seed=1):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny", seed=4)


@pytest.fixture(scope="module")
def torch_dir(checkpoint, tmp_path_factory):
    """An engine directory built with --backend torch (the build's smoke test on the torch backend included)."""
    torch.set_num_threads(1)
    return build_engine(tmp_path_factory.mktemp("engines") / "tiny-torch", POLICY, LIMITS, model=str(checkpoint),
                        backend="torch", log=lambda message: None)


def test_a_torch_build_names_its_checkpoint_and_exports_nothing(torch_dir, checkpoint):
    manifest = read_manifest(torch_dir)
    assert "onnx" not in manifest and manifest["torch"]["checkpoint"] == str(checkpoint.resolve())
    assert manifest["torch"]["fingerprint"]["weight_bytes"]  # the weight files' sizes are recorded
    assert sorted(p.name for p in torch_dir.iterdir()) == ["manifest.json", "tokenizer"]
    smoke = manifest["smoke_test"]
    assert smoke["tokens_match_pytorch"] and smoke["kept_indices_match_pytorch"] and smoke["device"] == "cpu"
    # the shapes are the ONNX build's: the same capacities for the same policy and limits, and a context policy as an
    # ONNX build's (the default's stand-in: this random model has no KVzip surrogate), its rows held in the decode rows
    capacities = [node_capacity(POLICY, 160, 2, layer, 3) for layer in range(3)]
    assert manifest["shapes"]["prefill_capacity"] == capacities
    context = KVPolicy.from_dict(manifest["context_policy"])
    assert context == parse_policy_spec(SURROGATE_FALLBACK, KVPolicy(budget=POLICY.budget, window=POLICY.window))
    held = [max(c, node_capacity(context, 160, 2, layer, 3)) for layer, c in enumerate(capacities)]
    assert manifest["shapes"]["context_capacity"] == [node_capacity(context, 160, 2, layer, 3) for layer in range(3)]
    assert manifest["shapes"]["decode_capacity"] == [c + 16 + 8 for c in held]
    assert manifest["method_data"]["kvzip"]["prompt"]  # the re-read's prompt in the tokenizer's ids
    assert manifest["request"]["backend"] == "torch"


def test_it_loads_on_the_torch_backend_and_generates_what_the_exported_engine_does(torch_dir, checkpoint, tmp_path):
    engine = Engine.load(torch_dir, device="cpu")  # no backend named: the directory's own
    exported = Engine.load(export_tiny_engine(tiny_model("llama", seed=4), POLICY, tmp_path / "onnx",
                                              **{k: v for k, v in LIMITS.to_dict().items() if k != "kv_dtype"}))
    try:
        assert engine.backend.name == "torch" and engine.limits.max_question_len == 16
        prompts = [prompt(150, seed=2), prompt(90, seed=3)]
        got = engine.generate(prompts, max_new_tokens=6, stop_token_ids=[], kv_budget=24)
        want = exported.generate(prompts, max_new_tokens=6, stop_token_ids=[], kv_budget=24)
        assert got.tokens == want.tokens
        for layer in range(3):
            for row in range(2):
                for head in range(2):
                    assert got.kept(layer, row, head) == want.kept(layer, row, head)
        assert got.kv_bytes_kept == want.kv_bytes_kept and got.selection_s is not None
    finally:
        engine.close()
        exported.close()


def test_the_other_backends_refuse_it_by_name(torch_dir):
    with pytest.raises(EngineError, match="no ONNX graphs in this engine directory \\(built with --backend torch\\)"):
        Engine.load(torch_dir, backend="onnxruntime")
    with pytest.raises(EngineError, match="built with --backend torch, which exports no graph"):
        Engine.load(torch_dir, backend="tensorrt")


def test_a_changed_or_missing_checkpoint_is_refused(torch_dir, checkpoint, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(torch_dir, copy)
    moved = tmp_path / "moved"
    shutil.copytree(checkpoint, moved)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["torch"]["checkpoint"] = str(moved)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    Engine.load(copy, verify=False).close()  # the same files elsewhere: fine
    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="changed since the engine was built"):
        Engine.load(copy, verify=False)
    shutil.rmtree(moved)
    with pytest.raises(EngineError, match="is not there \\(no config.json\\)"):
        Engine.load(copy, verify=False)
    # a directory that records no checkpoint of its own (an exported one) runs the checkpoint its model was read from
    manifest["torch"] = {"checkpoint": None}
    manifest["model"]["path"] = str(checkpoint)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    engine = Engine.load(copy, verify=False, device="cpu")
    assert engine.backend.name == "torch" and engine.generate([prompt(50)], max_new_tokens=2).tokens[0]
    engine.close()


def test_an_in_memory_engine_needs_its_model(tmp_path):
    folder = export_tiny_engine(tiny_model("llama", seed=4), POLICY, tmp_path / "e")  # the manifest names no path
    with pytest.raises(EngineError, match="names no checkpoint .* pass the model"):
        Engine.load(folder, backend="torch")
    with pytest.raises(EngineError, match="does not match the engine's manifest"):
        Engine.load(folder, backend="torch", model=tiny_model("llama", seed=4, layers=2))


def test_full_rows_and_positions_beyond_the_built_limits_are_refused(torch_dir):
    engine = Engine.load(torch_dir, device="cpu")
    try:
        result = engine.prefill(0, Request(prompt(150), ))
        assert result.kept_entries < 150 * 3 * 2  # compressed
        backend = engine.backend
        with pytest.raises(EngineError, match=r"position 184 is beyond the engine's 184"):
            backend.decode(np.array([3]), np.array([184]))
        backend._row_max[0] = backend.capacities  # as if every slot were taken
        with pytest.raises(EngineError, match=f"the KV buffer \\({backend.capacities[0]} entries per head\\) is full"):
            engine.decode([0], [3])
        with pytest.raises(EngineError, match="more entries do not fit the KV buffer"):
            engine.extend(0, [4, 5])
    finally:
        engine.release_all()
        engine.close()


@pytest.mark.parametrize("case", POLICY_CASES, ids=[case[0] for case in POLICY_CASES])
def test_a_layers_full_kv_is_freed_as_soon_as_it_is_selected(case, tmp_path):
    """Peak memory of a prefill = one layer's full K/V + the kept entries: when layer i is selected, no earlier layer's
    full keys or values are alive any more (by reference counting: the selection leaves no reference cycle)."""
    import weakref

    policy = make_policy(case[1], budget=40, window=8)
    if policy.method.scored_apart:
        pytest.skip(f"{case[0]}: scored apart (its method's phases), selected over the whole prompt's buffer, not in "
                    "the prefill's layer loop")
    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, policy, tmp_path / "e")
    engine = Engine.load(folder, backend="torch", model=model)
    backend = engine.backend
    alive, select = [], backend._select

    def watched(i, queries, keys, values, *rest):
        assert all(ref() is None for ref in alive), f"layer {i}: an earlier layer's full K/V is still held"
        out = select(i, queries, keys, values, *rest)
        alive.extend([weakref.ref(keys), weakref.ref(values)])
        return out

    backend._select = watched
    try:
        engine.prefill(0, Request(prompt(150)))
        assert len(alive) == 2 * 3
    finally:
        engine.release_all()
        engine.close()


@pytest.mark.parametrize("name", ["layer-defensivekv", "ada-criticalkv"])
def test_the_selection_ops_select_what_the_reference_selects_in_the_backend(name, tmp_path):
    """selection="native": the ops (on the CPU their host version; a model-level policy ranked layer by layer in the
    prefill's loop, then select_model) keep the entries the reference keeps, on a padded batch and at a request's
    budget."""
    from criticalkv.selection.op import load_torch_ops

    if load_torch_ops() is not None:
        pytest.skip(load_torch_ops())
    policy = KVPolicy(name, budget=40, window=8, head_cap_ratio=2.0 if name.startswith("layer") else 0.0)
    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, policy, tmp_path / "e", max_batch_size=2)
    kept = {}
    for selection in ("native", "reference"):
        engine = Engine.load(folder, backend="torch", model=model, selection=selection)
        try:
            ids = [prompt(150, seed=2), prompt(120, seed=3)]
            width = max(map(len, ids))
            batch = np.array([[0] * (width - len(x)) + x for x in ids], np.int64)
            mask = (np.arange(width)[None, :] >= width - np.array([150, 120])[:, None]).astype(np.int64)
            positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
            out = engine.backend.prefill(batch, mask, positions, kv_budget=30)
            kept[selection] = ([x.copy() for x in out.indices], [x.copy() for x in out.lengths])
        finally:
            engine.close()
    for a, b in zip(kept["native"][0], kept["reference"][0]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(kept["native"][1], kept["reference"][1]):
        np.testing.assert_array_equal(a, b)


def test_a_padded_batch_decodes_its_rows_as_the_exact_batch(tmp_path):
    """On a GPU a step over B rows runs a graph captured for the next padded size (3 -> 4): the extra row is a free
    row, here one whose heads are full (its new entry is clamped into the last slot); the real rows' logits are those
    of the step over exactly B rows (run eagerly here, the capture replaced by nothing)."""
    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, POLICY, tmp_path / "e", max_batch_size=5)
    logits = {}
    for padded in (False, True):
        engine = Engine.load(folder, backend="torch", model=model)
        backend = engine.backend
        if padded:
            backend.use_graphs = True
            backend._capture = lambda batch, span: None
            backend.length_block[:, 3] = torch.tensor(backend.capacities)[:, None]
        try:
            for slot in range(3):
                engine.prefill(slot, Request(prompt(60 + 30 * slot, seed=slot)))
            assert backend.padded_batch(3) == (4 if padded else 3) and backend.padded_batch(5) == 5
            logits[padded] = np.stack([engine.decode([0, 1, 2], [5, 6, 7]).copy() for _ in range(3)])
        finally:
            engine.release_all()
            engine.close()
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-5)


def test_a_step_reads_the_span_its_rows_hold_not_their_capacity(tmp_path):
    """A short sequence in a long engine (full: capacity 544 per head) is attended over a span of 256 entries, with
    the logits of the step over the whole capacity (masked)."""
    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, KVPolicy("full"), tmp_path / "e")
    logits = {}
    for whole in (False, True):
        engine = Engine.load(folder, backend="torch", model=model)
        backend = engine.backend
        if whole:
            backend.span = lambda longest: max(backend.capacities)
        try:
            engine.prefill(0, Request(prompt(40)))
            assert backend.span(int(backend._row_max[0].max()) + 1) == (max(backend.capacities) if whole else 256)
            logits[whole] = np.stack([engine.decode([0], [5 + t]).copy() for t in range(3)])
        finally:
            engine.release_all()
            engine.close()
    assert max(backend.capacities) > 256
    np.testing.assert_allclose(logits[False], logits[True], rtol=0, atol=1e-5)


def test_generate_command_runs_a_torch_engine(torch_dir):
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "generate", "--engine-dir", str(torch_dir), "--prompt",
         "w40 w41 w42 " * 30, "--json", "--max-new-tokens", "4"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["backend"] == "torch" and out["new_tokens"] == 4 and out["prompt_tokens"] == 90
    assert out["kv_bytes"]["kept"] < out["kv_bytes"]["full"] and out["timings"]["selection_s"] > 0


# ---------------------------------------------------------------------- what a GPU serving path reads and holds
def test_a_step_reads_at_most_an_eighth_more_than_its_rows_hold(tmp_path):
    """The decode step's span (entries per head its attention reads) covers the longest head and exceeds it by at most
    1/8 beyond 256 (budget 2048: a head of 2,049 entries read 4,096 when spans were powers of two); it never shrinks as
    rows grow; and the step is handed exactly that span per layer (capped at the layer's capacity)."""
    from criticalkv.runtime.torch_backend import TorchBackend

    lengths = np.arange(1, 140_000)
    spans = np.array([TorchBackend.span(n) for n in lengths])
    assert (spans >= lengths).all() and (np.diff(spans) >= 0).all()
    assert (spans[lengths <= 256] == 256).all()
    long = lengths > 256
    assert (spans[long] <= lengths[long] * 9 / 8).all()
    assert TorchBackend.span(2049) == 2304 and TorchBackend.span(4097) == 4608
    assert len({TorchBackend.span(n) for n in range(257, 4097)}) == 8 * 4  # 8 graphs per doubling

    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, KVPolicy("full"), tmp_path / "e", max_input_len=320, max_batch_size=1)
    engine = Engine.load(folder, backend="torch", model=model)
    backend, seen = engine.backend, []
    step = backend.decoder.decode_step

    def watched(*args):
        seen.append(list(args[8]))
        return step(*args)

    backend.decoder.decode_step = watched
    try:
        engine.prefill(0, Request(prompt(300)))
        engine.decode([0], [7])
        longest = int(backend._row_max[0].max())
        assert longest == 301 and seen == [[min(TorchBackend.span(longest), cap) for cap in backend.capacities]]
        assert seen[0][0] == 320 < 512  # a power of two would read 512
    finally:
        engine.release_all()
        engine.close()


def test_a_greedy_generation_takes_its_argmax_on_the_device(torch_dir):
    """``Engine.generate`` with greedy sampling decodes through ``decode_greedy`` (B ids to the host), never through
    ``decode`` (B x vocab float32 logits), static batch and slots alike, with the same tokens as the logits path;
    sampling at a temperature still reads the logits."""
    engine = Engine.load(torch_dir, device="cpu")
    backend, calls = engine.backend, {"decode": 0, "decode_greedy": 0}
    for name in calls:
        original = getattr(backend, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        setattr(backend, name, counted)
    prompts = [prompt(150, seed=2), prompt(90, seed=3)]
    try:
        greedy = engine.generate(prompts, max_new_tokens=6, stop_token_ids=[])
        assert calls == {"decode": 0, "decode_greedy": 5}
        questions = engine.generate([prompt(100)], max_new_tokens=4, stop_token_ids=[], questions=[prompt(5, seed=9)])
        assert calls == {"decode": 0, "decode_greedy": 8} and len(questions.tokens[0]) == 4
        del backend.decode_greedy  # the instance's counter; then a backend without it: the logits path
        saved = type(backend).decode_greedy
        delattr(type(backend), "decode_greedy")
        try:
            logits_path = engine.generate(prompts, max_new_tokens=6, stop_token_ids=[])
        finally:
            type(backend).decode_greedy = saved
        assert calls["decode"] == 5 and logits_path.tokens == greedy.tokens
        from criticalkv.request import SamplingParams

        engine.generate(prompts, max_new_tokens=3, stop_token_ids=[], sampling=SamplingParams(temperature=0.7, seed=1))
        assert calls["decode"] == 5 + 2
    finally:
        engine.close()


def test_a_padded_prefill_runs_causal_attention_without_a_mask(torch_dir, monkeypatch):
    """A left-padded batch's prefill attends per sequence with ``is_causal`` and grouped K/V: no [B, 1, n, n] mask and
    no K/V repeated for every query head, so a GPU runs flash attention (the tokens and kept entries of such a batch
    equal ONNX Runtime's: test_it_loads_on_the_torch_backend_and_generates_what_the_exported_engine_does)."""
    import torch.nn.functional as F

    engine = Engine.load(torch_dir, device="cpu")
    calls, sdpa = [], F.scaled_dot_product_attention

    def watched(q, k, v, attn_mask=None, is_causal=False, **options):
        calls.append((q.shape, k.shape, attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **options)

    from criticalkv.request import SamplingParams

    ids, mask, _ = engine._batch([prompt(150, seed=2), prompt(90, seed=3)], None, SamplingParams(), None)
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
    monkeypatch.setattr(F, "scaled_dot_product_attention", watched)
    try:
        engine.backend.prefill(ids, mask, positions)
    finally:
        engine.close()
    assert len(calls) == 3 * 2  # every layer, each sequence alone
    assert all(no_mask and causal for _, _, no_mask, causal in calls)
    assert {(q[0], q[2], k[1]) for q, k, _, _ in calls} == {(1, 150, 2), (1, 90, 2)}  # its own tokens, H_kv heads


def test_a_layers_selection_runs_before_its_mlp_and_frees_its_full_qkv(tmp_path):
    """The selection of layer i runs right after its attention: when layer i's MLP starts, layer i was selected and
    its full-length queries, keys and values are gone (the MLP's activations never sit beside them)."""
    import weakref

    model = tiny_model("llama", seed=4)
    folder = export_tiny_engine(model, POLICY, tmp_path / "e")
    engine = Engine.load(folder, backend="torch", model=model)
    backend, held, select = engine.backend, {}, engine.backend._select

    def watched(i, queries, keys, values, *rest):
        held[i] = [weakref.ref(queries._base if queries._base is not None else queries), weakref.ref(keys),
                   weakref.ref(values)]
        return select(i, queries, keys, values, *rest)

    def before_mlp(i):
        def hook(module, args):
            assert i in held, f"layer {i}: its MLP runs before its selection"
            assert all(ref() is None for ref in held[i]), f"layer {i}: its full Q/K/V live through its MLP"
            checked.append(i)
        return hook

    checked = []
    backend._select = watched
    hooks = [layer.mlp.register_forward_pre_hook(before_mlp(i)) for i, layer in enumerate(backend.decoder.layers)]
    try:
        engine.prefill(0, Request(prompt(150)))
        assert checked == [0, 1, 2]
    finally:
        for hook in hooks:
            hook.remove()
        engine.release_all()
        engine.close()


def test_prefill_time_includes_loading_the_decode_rows(torch_dir):
    """A prefill's time ends when its kept entries sit in the decode rows (``begin_decode`` / ``load_row``, then a
    device sync), not when the selection returns: TTFT is not flattered."""
    import time as clock

    engine = Engine.load(torch_dir, device="cpu")
    backend = engine.backend
    for name in ("begin_decode", "load_row"):
        original = getattr(backend, name)

        def slow(*args, _original=original):
            clock.sleep(0.3)
            return _original(*args)

        setattr(backend, name, slow)
    try:
        assert engine.generate([prompt(60)], max_new_tokens=1, stop_token_ids=[]).prefill_s >= 0.3
        assert engine.prefill(0, Request(prompt(60))).seconds >= 0.3
    finally:
        engine.release_all()
        engine.close()


def test_the_checkpoint_loads_without_accelerate(checkpoint, torch_dir):
    """A GPU image without ``accelerate`` (transformers refuses a ``device_map`` then): the checkpoint still loads, onto
    a non-CPU device too (the meta device stands in for CUDA here), and a torch engine built from it loads and
    generates. Run in a process where ``accelerate`` cannot be imported, whatever this environment has."""
    script = f"""
import sys
sys.modules["accelerate"] = None  # find_spec gives None, import raises: as if it were not installed
import torch
from transformers.utils import is_accelerate_available
assert not is_accelerate_available()
from criticalkv.runtime import Engine
from criticalkv.runtime.torch_backend import load_checkpoint
on_cpu = load_checkpoint({str(checkpoint)!r}, torch.float32, torch.device("cpu"))
assert {{p.device.type for p in on_cpu.parameters()}} == {{"cpu"}}
moved = load_checkpoint({str(checkpoint)!r}, torch.float32, torch.device("meta"))
assert {{p.device.type for p in moved.parameters()}} == {{"meta"}}
engine = Engine.load({str(torch_dir)!r}, device="cpu")
try:
    print("tokens", engine.generate([[5, 6, 7, 8, 9] * 12], max_new_tokens=3, stop_token_ids=[]).tokens)
finally:
    engine.close()
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens [[" in run.stdout


def test_the_checkpoint_goes_straight_to_a_gpu_only_through_accelerate(checkpoint, monkeypatch):
    """With accelerate, transformers places the weights on a non-CPU device as it reads them (``device_map``); on the
    CPU, or without accelerate, no device_map is passed (transformers would refuse one without accelerate)."""
    import transformers
    import transformers.utils

    from criticalkv.runtime.torch_backend import load_checkpoint

    seen, original = [], transformers.AutoModelForCausalLM.from_pretrained

    def recorded(*args, **options):
        seen.append(options.get("device_map"))
        if options.get("device_map") == "meta":  # what accelerate would do: weights left unread on that device
            options = {k: v for k, v in options.items() if k != "device_map"}
        return original(*args, **options)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recorded)
    for available in (True, False):
        monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda available=available: available)
        assert {p.device.type for p in load_checkpoint(checkpoint, torch.float32, torch.device("cpu")).parameters()} == {"cpu"}
        assert {p.device.type for p in load_checkpoint(checkpoint, torch.float32, torch.device("meta")).parameters()} == {"meta"}
    assert seen == [None, "meta", None, None]


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_graphs_replay_the_eager_step_and_match_the_cpu(torch_dir):
    """fp32 on the GPU: the captured decode step gives the eager step's logits, and the tokens are the CPU's."""
    prompts = [prompt(150, seed=5), prompt(120, seed=6)]
    cpu = Engine.load(torch_dir, device="cpu")
    try:
        want = cpu.generate(prompts, max_new_tokens=8, stop_token_ids=[])
    finally:
        cpu.close()
    logits = {}
    for graphs in (True, False):
        engine = Engine.load(torch_dir, device="cuda", dtype="float32", cuda_graphs=graphs)
        try:
            got = engine.generate(prompts, max_new_tokens=8, stop_token_ids=[])
            assert got.tokens == want.tokens, f"cuda_graphs={graphs}"
            for slot, ids in enumerate(prompts):
                engine.prefill(slot, Request(ids))
            steps = [engine.decode([0, 1], [7, 9]).copy() for _ in range(4)]  # 1 eager step, then replays
            logits[graphs] = np.stack(steps)
            assert any(rows == engine.backend.padded_batch(2) for rows, _ in engine.backend._graphs) == graphs
        finally:
            engine.release_all()
            engine.close()
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_bfloat16_on_the_gpu_keeps_nearly_the_fp32_entries(torch_dir):
    """bf16 (what serving runs) against fp32 on the same GPU: the kept sets overlap almost entirely."""
    ids = prompt(150, seed=7)
    kept = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine.load(torch_dir, device="cuda", dtype=dtype)
        try:
            out = engine.generate([ids], max_new_tokens=4, stop_token_ids=[])
            kept[dtype] = [set(out.kept(layer, 0, head)) for layer in range(3) for head in range(2)]
        finally:
            engine.close()
    overlap = np.mean([len(a & b) / len(a) for a, b in zip(kept["float32"], kept["bfloat16"])])
    assert overlap > 0.9


@pytest.mark.parametrize("spec", ["kvzip", "kvzip:kvzip_reread=chunk:kvzip_chunk=48",
                                  "layer-kvzip-criticalkv:kvzip_chunk=64", "kvzip-criticalkv:head_cap_ratio=2"])
def test_kvzip_runs_on_torch_with_the_kept_entries_and_tokens_of_onnx_runtime(spec, tmp_path):
    """The torch backend runs a method's phases: KVzip's context reconstruction as re-read passes through the model's
    own layers (over the whole context, or a local buffer per chunk), the per-layer and the model-wide allocations:
    the same kept entries and tokens as ONNX Runtime, static batch and a question after a compressed context; a torch
    build takes the policy (its manifest keeps the reconstruction prompt)."""
    from criticalkv.build import torch_engine_content
    from criticalkv.export.exporter import BuildConfig
    from criticalkv.policy import parse_policy_spec

    model = tiny_model("llama", seed=4)
    policy = parse_policy_spec(spec, KVPolicy(budget=40, window=8))
    content = torch_engine_content(model, policy, BuildConfig(max_input_len=256, max_new_tokens=8))
    assert "prompt" in content["method_data"]["kvzip"]
    folder = export_tiny_engine(model, policy, tmp_path / "e", extend_chunk=32, max_question_len=24)
    got = {}
    for backend in ("onnxruntime", "torch"):
        engine = Engine.load(folder, backend=backend, model=model) if backend == "torch" else Engine.load(folder)
        try:
            out = engine.generate([prompt(150, seed=2), prompt(110, seed=3)], max_new_tokens=5, stop_token_ids=[])
            asked = engine.generate([prompt(120, seed=4)], max_new_tokens=5, stop_token_ids=[],
                                    questions=[prompt(9, seed=5)])
            got[backend] = (out.tokens, [[out.kept(layer, row, head) for head in range(2)] for layer in range(3)
                                         for row in range(2)], asked.tokens)
        finally:
            engine.close()
    assert got["torch"] == got["onnxruntime"]


def test_an_engine_with_a_context_policy_selects_contexts_with_it_on_torch(tmp_path):
    """An engine built with a context policy (kvzip; build_engine's default is its model-level two-stage variant)
    compresses contexts with it on the torch backend too: the same kept entries as ONNX Runtime, and not the engine's
    own policy's."""
    model = tiny_model("llama", seed=4)
    policy = KVPolicy("criticalkv", budget=40, window=8)
    folder = export_tiny_engine(model, policy, tmp_path / "e", context_policy=KVPolicy("kvzip", budget=40, window=8))
    kept = {}
    for backend in ("onnxruntime", "torch"):
        engine = Engine.load(folder, backend=backend, model=model) if backend == "torch" else Engine.load(folder)
        try:
            assert engine.context_policy == KVPolicy("kvzip", budget=40, window=8)
            for context in (True, False):
                result = engine.prefill(0, Request(prompt(150)), context=context)
                kept[backend, context] = [k.tolist() for k in result.kept_indices]
                engine.release(0)
        finally:
            engine.release_all()
            engine.close()
    assert kept["torch", True] == kept["onnxruntime", True]
    assert kept["torch", False] == kept["onnxruntime", False] != kept["torch", True]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_question_after_a_restored_context_of_unequal_heads_gives_onnx_runtimes_tokens(device, tmp_path):
    """An equal-heads engine policy (criticalkv) with a context policy of unequal heads (layer-kvzip-criticalkv): a
    question after the compressed context, once right after its compression and once after the context was saved, the
    slot used by another sequence's decode and the context restored (the serving context cache's hit), gives ONNX
    Runtime's tokens both times. The extend may use one mask for all heads only when the row's heads hold equal counts:
    the slots past a short head's length hold the earlier sequence's entries. On CUDA: fp32, decode steps captured."""
    model = tiny_model("llama", seed=4)
    context_policy = KVPolicy("layer-kvzip-criticalkv", budget=40, window=8, head_cap_ratio=3.0)
    folder = export_tiny_engine(model, KVPolicy("criticalkv", budget=40, window=8), tmp_path / "e",
                                context_policy=context_policy)
    context, question = prompt(150, seed=5), prompt(9, seed=6)
    tokens = {}
    for backend in ("onnxruntime", "torch"):
        engine = Engine.load(folder, backend=backend, model=model, device=device, dtype="float32") \
            if backend == "torch" else Engine.load(folder)
        try:
            result = engine.prefill(0, Request(context), context=True)
            assert any(len(set(np.ravel(layer).tolist())) > 1 for layer in result.kept_lengths)  # unequal heads
            snapshot = engine.save(0)
            runs = []
            for restored in (False, True):
                if restored:  # another sequence in the slot (its entries fill the row), then the cached context
                    engine.release(0)
                    out = engine.prefill(0, Request(prompt(200, seed=7)))
                    logits, token = out.logits, None
                    for _ in range(12):
                        token = int(np.argmax(logits))
                        logits = engine.decode([0], np.array([token]))[0]
                    engine.release(0)
                    engine.restore(0, snapshot)
                logits, run = engine.extend(0, question), []
                for _ in range(6):
                    run.append(int(np.argmax(logits)))
                    logits = engine.decode([0], np.array([run[-1]]))[0]
                runs.append(run)
            tokens[backend] = runs
        finally:
            engine.release_all()
            engine.close()
    assert tokens["onnxruntime"][0] == tokens["onnxruntime"][1]
    assert tokens["torch"] == tokens["onnxruntime"]
