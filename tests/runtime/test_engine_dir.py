"""Engine directories: build_engine (atomic, manifest, TensorRT report), loading checks, the CLI."""

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import shlex
import time
from pathlib import Path

import pytest

from criticalkv import KVPolicy
from criticalkv.cli import main
from criticalkv.export import BuildConfig
from criticalkv.build import build_engine
from criticalkv.runtime import FORMAT_VERSION, Engine, EngineError, read_manifest
from criticalkv.runtime.manifest import sha256_file
from export.tiny_engine import save_tiny_checkpoint, words

ROOT = Path(__file__).resolve().parents[2]
POLICY = KVPolicy("criticalkv", budget=40, window=8)
CONFIG = BuildConfig(max_input_len=256, max_new_tokens=32, max_batch_size=2, attention_chunk=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", "llama", seed=3)


@pytest.fixture(scope="module")
def built(checkpoint, tmp_path_factory):
    """One engine built the way scripts/build_engine.py builds it (smoke test included)."""
    messages = []
    output = tmp_path_factory.mktemp("out") / "engine"
    build_engine(output, POLICY, CONFIG, model=str(checkpoint), log=messages.append)
    return output, messages


def copy_engine(built, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(built[0], target)
    return target


def test_build_writes_a_complete_manifest(built, checkpoint):
    output, messages = built
    manifest = read_manifest(output, verify=True)
    assert manifest["format_version"] == FORMAT_VERSION
    assert KVPolicy.from_dict(manifest["policy"]) == POLICY
    assert manifest["build"] == CONFIG.to_dict()
    assert manifest["model"]["spec"]["num_kv_heads"] == 2 and manifest["model"]["path"] == str(checkpoint)
    assert manifest["onnx"]["opset"] == 21 and manifest["onnx"]["custom_domain"] == {"ai.criticalkv": 1}
    # the context cache's policy: build_engine's default needs the model's KVzip surrogate, which this checkpoint has
    # not, so the re-read's (layer-kvzip-criticalkv with a head cap of 3x the budget): its select graph and the
    # reconstruct graphs (portable, fused); tests/selection/test_surrogate.py builds one with a surrogate
    assert any("no KVzip surrogate" in m and "criticalkv train-surrogate" in m for m in messages)
    graphs = {"prefill", "prefill_tensorrt", "decode", "decode_ort", "extend", "extend_tensorrt", "select",
              "select_tensorrt", "prefill_ort", "extend_ort", "extend_heads_ort", "select_context", "reread", "reread_ort",
              "prefill_openvino", "extend_openvino", "select_openvino", "decode_openvino", "select_context_openvino"}
    assert KVPolicy.from_dict(manifest["context_policy"]) == KVPolicy("layer-kvzip-criticalkv", budget=POLICY.budget,
                                                                      window=POLICY.window, head_cap_ratio=3.0)
    assert manifest["method_data"]["kvzip"]["prompt"]["first"]  # kvpress's repeat prompt in the tokenizer's ids
    assert set(manifest["onnx"]["validation"]) == graphs
    assert set(manifest["onnx"]["files"]) == graphs | {"weights"}
    assert manifest["onnx"]["fused_decode"]["file"] == "decode_ort.onnx"
    assert manifest["onnx"]["fused_prompt"]["prefill"] == "prefill_ort.onnx" and manifest["onnx"]["weights"] == {"format": "fp32"}
    assert {"python", "torch", "transformers", "onnx", "onnxruntime", "numpy"} <= set(manifest["versions"])
    files = {p.relative_to(output).as_posix() for p in output.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert {"weights.bin", "prefill.onnx", "prefill_tensorrt.onnx", "decode.onnx", "decode_ort.onnx", "extend.onnx",
            "extend_tensorrt.onnx", "select.onnx", "select_tensorrt.onnx", "prefill_ort.onnx", "extend_ort.onnx"} <= files
    assert any(f.startswith("tokenizer/") for f in files)
    for rel, info in manifest["files"].items():
        assert info["sha256"] == sha256_file(output / rel)
    smoke = manifest["smoke_test"]
    assert smoke["tokens_match_pytorch"] and smoke["kept_indices_match_pytorch"] and smoke["prompt_tokens"] > 40
    # no TensorRT here: the build says exactly what it skipped and why, and still succeeds
    assert manifest["tensorrt"]["built"] is False and manifest["tensorrt"]["skipped_reason"]
    assert any(m.startswith("TensorRT engines: SKIPPED because") for m in messages)
    assert not list(output.parent.glob(".*building*"))


def test_rebuilding_the_same_request_is_a_no_op_and_a_different_one_needs_force(built, checkpoint):
    output, _ = built
    before = (output / "manifest.json").read_text()
    messages = []
    build_engine(output, POLICY, CONFIG, model=str(checkpoint), log=messages.append)
    assert "already built" in messages[-1] and (output / "manifest.json").read_text() == before
    with pytest.raises(EngineError, match="--force"):
        build_engine(output, POLICY.replace(budget=48), CONFIG, model=str(checkpoint), log=messages.append)


def test_force_replaces_an_engine_atomically(checkpoint, tmp_path):
    output = tmp_path / "engine"
    build_engine(output, POLICY, CONFIG, model=str(checkpoint), smoke=False, log=lambda m: None)
    build_engine(output, POLICY.replace(name="snapkv"), CONFIG, model=str(checkpoint), force=True, smoke=False,
                 log=lambda m: None)
    assert read_manifest(output)["policy"]["name"] == "snapkv"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def _file(path):
    path.write_text("my notes\n")


def _notes(path):
    path.mkdir()
    (path / "notes.txt").write_text("my notes\n")


def _git_checkout(path):
    (path / ".git").mkdir(parents=True)
    (path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


def _foreign_manifest(path):
    path.mkdir()
    (path / "manifest.json").write_text('{"name": "some other tool"}')


def _link_to_notes(path):
    _notes(path.parent / "elsewhere")
    path.symlink_to(path.parent / "elsewhere")


@pytest.mark.parametrize("make, what", [
    (_file, "is a file"), (_notes, "holds notes.txt"), (_git_checkout, "holds .git"),
    (_foreign_manifest, "holds manifest.json"), (_link_to_notes, "is a symbolic link"),
])
def test_force_never_replaces_what_is_not_an_engine(checkpoint, tmp_path, make, what):
    output = tmp_path / "target"
    make(output)
    before = sorted((p.relative_to(tmp_path).as_posix(), p.is_file() and p.read_text()) for p in tmp_path.rglob("*"))
    for force in (False, True):
        with pytest.raises(EngineError, match=f"{what}.*refusing to replace it"):
            build_engine(output, POLICY, CONFIG, model=str(checkpoint), force=force, smoke=False, log=lambda m: None)
    after = sorted((p.relative_to(tmp_path).as_posix(), p.is_file() and p.read_text()) for p in tmp_path.rglob("*"))
    assert after == before


@pytest.mark.parametrize("budget, max_input_len", [(99999, 256), (256, 100), (40, 40)])
def test_an_engine_that_would_never_evict_is_refused_before_exporting(checkpoint, tmp_path, budget, max_input_len):
    with pytest.raises(ValueError, match=f"budget {budget} >= --max-input-len {max_input_len}: .*kept whole"):
        build_engine(tmp_path / "engine", POLICY.replace(budget=budget),
                     dataclasses.replace(CONFIG, max_input_len=max_input_len),
                     model=str(checkpoint), log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_output_directory_is_built_into(checkpoint, tmp_path):
    (tmp_path / "engine").mkdir()
    build_engine(tmp_path / "engine", POLICY, CONFIG, model=str(checkpoint), smoke=False, log=lambda m: None)
    assert read_manifest(tmp_path / "engine")["policy"]["name"] == POLICY.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_interrupted_build_leaves_nothing_behind(checkpoint, tmp_path, monkeypatch, error):
    import criticalkv.build as build

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(build, "validate_export", fail)
    with pytest.raises(type(error)):
        build_engine(tmp_path / "engine", POLICY, CONFIG, model=str(checkpoint), log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sigterm_during_a_build_leaves_nothing_behind(checkpoint, tmp_path):
    """``timeout``, ``kill`` or a CI cancellation: handled like Ctrl-C (temporary directory and lock removed)."""
    build = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "build_engine.py"), "--model", str(checkpoint), "--budget", "40",
         "--window", "8", "--max-input-len", "128", "--max-new-tokens", "8", "--output", str(tmp_path / "engine")],
        stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".engine.building-*")) and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    build.send_signal(signal.SIGTERM)
    _, err = build.communicate(timeout=120)
    assert build.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "build_engine: terminated (SIGTERM); nothing was written"
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_the_next_build_removes_what_killed_builds_left_and_says_so(built, tmp_path):
    """SIGKILL / the OOM killer leave a temporary directory (and a lock file) that the next build of the same
    output removes; one of a live process, or of another output, stays."""
    engine = copy_engine(built, tmp_path)
    dead = dead_pid()
    stale = [tmp_path / f".copy.building-{dead}-x1y2", tmp_path / ".copy.building-k3j4h5g6",
             tmp_path / f".copy.old-{dead}-z9"]
    kept = [tmp_path / f".copy.building-{os.getppid()}-live", tmp_path / f".other.building-{dead}-x"]
    for path in stale + kept:
        path.mkdir()
        (path / "weights.bin").write_bytes(b"0" * 1000)
    (tmp_path / ".copy.lock").write_text(f"{dead}\n")
    messages = []
    build_engine(engine, POLICY, CONFIG, model=str(read_manifest(engine)["model"]["path"]), log=messages.append)
    assert "already built" in messages[-1]
    for path in stale:
        assert not path.exists()
        assert any(m.startswith(f"removed {path}: a temporary left by ") for m in messages)
    assert all(path.exists() for path in kept) and not (tmp_path / ".copy.lock").exists()


def test_a_second_build_of_the_same_output_fails_clearly(built, tmp_path):
    from criticalkv.build import build_lock

    engine = copy_engine(built, tmp_path)
    with build_lock(engine):
        with pytest.raises(EngineError, match=f"{engine} is being built by another process \\(pid {os.getpid()}"):
            build_engine(engine, POLICY.replace(budget=48), CONFIG, model=str(read_manifest(engine)["model"]["path"]),
                         force=True, log=lambda m: None)
    assert read_manifest(engine)["policy"]["budget"] == POLICY.budget
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_missing_or_corrupt_engine_dirs_are_named(built, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such engine directory"):
        Engine.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="no manifest.json"):
        Engine.load(tmp_path / "empty")
    engine = copy_engine(built, tmp_path)
    manifest = json.loads((engine / "manifest.json").read_text())

    (engine / "manifest.json").write_text("{not json")
    with pytest.raises(EngineError, match="corrupt manifest"):
        Engine.load(engine)
    (engine / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99, "versions": {"criticalkv": "9.0"}}))
    with pytest.raises(EngineError, match="format_version 99 .*criticalkv 9.0.* Rebuild") as err:
        Engine.load(engine)
    # the command that rebuilds it, from what the manifest recorded of its build; it parses, with the same policy
    command = str(err.value).split("Rebuild it: ", 1)[1]
    words = shlex.split(command)
    assert words[:2] == ["python", "scripts/build_engine.py"] and words[-3:] == ["--output", str(engine), "--force"]
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_engine_script", ROOT / "scripts" / "build_engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    parsed = script.parse_args(words[2:])
    assert KVPolicy.from_args(parsed) == KVPolicy.from_dict(manifest["request"]["policy"])
    assert parsed.max_input_len == manifest["build"]["max_input_len"]
    (engine / "manifest.json").write_text(json.dumps({**manifest, "policy": {**manifest["policy"], "name": "bogus"}}))
    with pytest.raises(EngineError, match="invalid policy"):
        Engine.load(engine)
    (engine / "manifest.json").write_text(json.dumps(manifest))

    weights = engine / "weights.bin"
    data = bytearray(weights.read_bytes())
    weights.write_bytes(bytes(data[:-10]))
    with pytest.raises(EngineError, match="weights.bin has .* bytes"):
        Engine.load(engine)
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="weights.bin does not match its sha256"):
        Engine.load(engine)
    (engine / "decode.onnx").unlink()
    with pytest.raises(EngineError, match="missing file decode.onnx"):
        Engine.load(engine, verify=False)


def test_a_corrupt_graph_is_reported_not_crashed_on(built, tmp_path):
    engine = copy_engine(built, tmp_path)
    path = engine / "prefill.onnx"
    path.write_bytes(b"\x08garbage" * (path.stat().st_size // 8) + b"x" * (path.stat().st_size % 8))
    with pytest.raises(EngineError, match="prefill.onnx"):
        Engine.load(engine, verify=False)


def cli_json(*args):
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "generate", *args, "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_cli_engine_dir_prints_the_same_fields_as_the_pytorch_path(built, checkpoint):
    text = words([(7 * i) % 120 + 2 for i in range(150)])
    ort_out = cli_json("--engine-dir", str(built[0]), "--prompt", text, "--max-new-tokens", "12")
    torch_out = cli_json("--model", str(checkpoint), "--prompt", text, "--max-new-tokens", "12",
                         "--kv-policy", "criticalkv", "--budget", "40", "--window", "8")
    assert set(ort_out) == set(torch_out)
    assert set(ort_out["timings"]) == set(torch_out["timings"]) and set(ort_out["kv_bytes"]) == set(torch_out["kv_bytes"])
    assert ort_out["backend"] == "onnxruntime" and torch_out["backend"] == "pytorch"
    assert ort_out["token_ids"] == torch_out["token_ids"] and ort_out["text"] == torch_out["text"]
    assert ort_out["policy"] == torch_out["policy"] and ort_out["kv_bytes"] == torch_out["kv_bytes"]
    assert ort_out["kept_whole"] is torch_out["kept_whole"] is False
    assert 0 < ort_out["timings"]["selection_s"] < ort_out["timings"]["prefill_s"]


def test_cli_engine_dir_errors(built, tmp_path, capsys):
    text = words(range(2, 100))
    assert main(["generate", "--engine-dir", str(built[0]), "--prompt", text, "--budget", "64"]) == 2
    assert "differs from the engine's policy" in capsys.readouterr().err
    assert main(["generate", "--engine-dir", str(built[0]), "--prompt", text, "--model", "x"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["generate", "--engine-dir", str(tmp_path / "none"), "--prompt", text]) == 2
    assert "no such engine directory" in capsys.readouterr().err
    assert main(["generate", "--engine-dir", str(built[0]), "--prompt", words([5] * 300), "--max-new-tokens", "8"]) == 2
    assert "more than the engine's max input length" in capsys.readouterr().err
    assert main(["generate", "--engine-dir", str(built[0]), "--prompt", text, "--max-new-tokens", "64"]) == 2
    assert "max_tokens must lie in [1, 32]" in capsys.readouterr().err


@pytest.mark.parametrize("n", [5, 20, 40])  # below the window (8), below the budget (40), equal to it
def test_a_prompt_that_fits_in_the_budget_is_kept_whole_on_both_paths(built, checkpoint, capsys, n):
    text = words([(3 * i) % 120 + 2 for i in range(n)])
    outs = []
    for source in (["--engine-dir", str(built[0])], ["--model", str(checkpoint), "--budget", "40", "--window", "8"]):
        assert main(["generate", *source, "--prompt", text, "--max-new-tokens", "4", "--json"]) == 0
        captured = capsys.readouterr()
        outs.append(json.loads(captured.out))
        assert f"the prompt ({n} tokens) fits in the budget (40): its KV cache is kept whole" in captured.err
    ort_out, torch_out = outs
    assert ort_out["prompt_tokens"] == n and ort_out["kept_whole"] and torch_out["kept_whole"]
    assert ort_out["kv_bytes"]["kept_fraction"] == torch_out["kv_bytes"]["kept_fraction"] == 1.0
    assert ort_out["token_ids"] == torch_out["token_ids"]


def test_build_engine_script_exits_0_and_says_what_it_skipped(checkpoint, tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_engine.py"), "--model", str(checkpoint), "--kv-policy", "snapkv",
         "--budget", "40", "--window", "8", "--max-input-len", "128", "--max-new-tokens", "8", "--skip-smoke-test",
         "--output", str(tmp_path / "engine")],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TensorRT engines: SKIPPED because" in run.stderr and "engine written to" in run.stderr
    if importlib.util.find_spec("tensorrt") is None:  # a CPU machine: one short line, no paragraph about TensorRT
        skipped = [line for line in run.stderr.splitlines() if line.startswith("TensorRT engines:")]
        assert skipped == ["TensorRT engines: SKIPPED because TensorRT is not installed here (no tensorrt Python "
                           "package); the ONNX Runtime engine is complete (GPU: docs/gpu.md)"], run.stderr
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_engine.py"), "--model", str(tmp_path / "missing"),
         "--output", str(tmp_path / "other")],
        capture_output=True, text=True,
    )
    assert bad.returncode == 2 and "no such model folder" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "other").exists()


def test_profiling_leaves_no_trace_files(built, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert main(["generate", "--engine-dir", str(built[0]), "--prompt", words(range(2, 100)), "--budget", "64"]) == 2
    engine = Engine.load(built[0], profile=True)
    engine.generate([list(range(2, 60))], max_new_tokens=2)
    engine.close()
    Engine.load(built[0], profile=True).close()
    assert list(tmp_path.iterdir()) == []


def test_cli_budget_within_the_engine_range_is_the_request_budget(built, capsys):
    # an engine serves any budget in [window, built budget] (a runtime input of its selection): --budget in that
    # range is this request's budget; outside it the command says what --budget must be
    text = words([(7 * i) % 120 + 2 for i in range(150)])
    base = ["generate", "--engine-dir", str(built[0]), "--prompt", text, "--max-new-tokens", "3", "--json"]
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(base + ["--budget", "16"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert default["policy"]["budget"] == 40 and small["policy"]["budget"] == 16
    assert small["kv_bytes"]["kept"] < default["kv_bytes"]["kept"]
    for bad in ("0", "7", "41"):
        assert main(base + ["--budget", bad]) == 2
        err = capsys.readouterr().err
        assert "per-request budgets in [8, 40] only (--budget must lie there)" in err, err


def test_cli_context_then_question_on_the_pytorch_path(checkpoint, capsys):
    # --context/--question: the context is compressed alone, then the question runs through the compressed cache
    # (criticalkv.hf.generate with question_ids); the JSON counts both
    import torch

    from criticalkv.hf import generate, load_model

    context, question = words([(5 * i) % 120 + 2 for i in range(140)]), words([9, 10, 11, 12])
    args = ["generate", "--model", str(checkpoint), "--budget", "40", "--window", "8", "--max-new-tokens", "6",
            "--json", "--context", context, "--question", question]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    model, tokenizer = load_model(str(checkpoint))
    ids = tokenizer(context)["input_ids"]
    q = tokenizer("\n\n" + question, add_special_tokens=False)["input_ids"]
    ref = generate(model, torch.tensor([ids]), POLICY, 6, question_ids=torch.tensor([q]))
    assert out["token_ids"] == ref.tokens[0] and (out["prompt_tokens"], out["question_tokens"]) == (len(ids), len(q))
    assert main(["generate", "--model", str(checkpoint), "--context", context]) == 2
    assert "--question goes with --context" in capsys.readouterr().err
    assert main(["generate", "--model", str(checkpoint), "--prompt", context, "--question", "why"]) == 2
    assert "--question goes with --context" in capsys.readouterr().err
