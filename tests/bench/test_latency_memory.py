"""``python -m benchmarks.latency``'s decode-memory step profiles the decode graph the backend runs."""

from criticalkv import KVPolicy
from benchmarks.latency import decode_memory
from criticalkv.runtime import Engine
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model


def test_decode_memory_profiles_the_graph_the_backend_runs(tmp_path):
    folder = export_tiny_engine(tiny_model("llama", seed=4), KVPolicy(name="criticalkv", budget=40, window=8),
                                tmp_path / "engine", max_batch_size=1)
    engine = Engine.load(folder, threads=1)
    backend = engine.backend
    assert backend.fused and backend.decode_path.name == "decode_ort.onnx"  # the default form of a new engine
    before = backend.decode_session
    ids = list(range(3, 103))
    out = decode_memory(engine, ids, 4)  # once ran decode.onnx with decode_ort.onnx's bindings (raised on SmolLM2)
    # a new (profiled) session of the same graph: the one the backend binds its buffers for, not decode.onnx
    assert backend.decode_session is not before
    signature = lambda sess: ([(i.name, i.shape) for i in sess.get_inputs()], [(o.name, o.shape) for o in sess.get_outputs()])
    assert signature(backend.decode_session) == signature(before)
    assert out["prompt_tokens"] == 100 and out["budget"] == 40
    assert out["kv_buffer_bytes"] == backend.kv_buffer_bytes() > 0
    assert out["decode_arena_held_bytes"] > 0
    assert out["decode_memory_bytes"] == out["kv_buffer_bytes"] + out["decode_arena_held_bytes"]
