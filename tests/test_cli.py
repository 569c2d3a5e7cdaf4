import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import criticalkv
from criticalkv import KVPolicy, select_layer
from criticalkv.cli import main
from helpers import random_layer


def test_policies_lists_every_policy(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "`ada-criticalkv`" in out and "`:pool_kernel=`" in out


def test_select_on_saved_tensors_matches_the_reference(tmp_path, capsys):
    q, k, v, o = random_layer(n=100, window=8, seed=3)
    path = tmp_path / "layer.pt"
    torch.save({"queries": q, "keys": k, "values": v, "o_proj_weight": o}, path)
    assert main(["select", str(path), "--kv-policy", "ada-criticalkv", "--budget", "32", "--window", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    ref = select_layer(KVPolicy("ada-criticalkv", budget=32, window=8), q, k, v, o)
    assert result["lengths"] == ref.lengths.tolist()
    assert result["indices"][0][1] == ref.indices[0, 1, : ref.lengths[0, 1]].tolist()


def test_select_reports_user_errors_without_traceback(tmp_path):
    torch.save({"queries": torch.zeros(1)}, tmp_path / "bad.pt")
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "select", str(tmp_path / "bad.pt")], capture_output=True, text=True
    )
    assert run.returncode == 2 and "missing tensor(s) keys" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "criticalkv.cli", "select", str(tmp_path / "none.pt"), "--budget", "8"],
        capture_output=True, text=True,
    )
    assert run.returncode == 2 and "budget: 8 is smaller than the window" in run.stderr


def _files(tmp_path):
    """The bad inputs of the table below, written into ``tmp_path``."""
    (tmp_path / "text.pt").write_text("hello")
    (tmp_path / "text.npz").write_text("hello")
    (tmp_path / "bad_config").mkdir()
    (tmp_path / "bad_config" / "config.json").write_text("{not json")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128}))
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)))
    (tmp_path / "folder").mkdir()


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is usable here")


@pytest.mark.parametrize("argv, message", [
    (["select", "{tmp}/text.pt"], "{tmp}/text.pt: not a tensor file saved with torch.save ("),
    (["select", "{tmp}/text.npz"], "{tmp}/text.npz: not a .npz file of arrays ("),
    (["generate", "--model", "{tmp}/bad_config", "--prompt", "hi"], "bad_config/config.json' is not a valid JSON file"),
    (["generate", "--model", "{tmp}/no_weights", "--prompt", "hi"], "no file named model.safetensors"),
    pytest.param(["generate", "--device", "cuda", "--prompt", "hi"], "--device cuda: not usable with this torch",
                 marks=NO_CUDA),
    (["generate", "--device", "gpu0", "--prompt", "hi"], "--device gpu0: not usable with this torch"),
    (["generate", "--backend", "tensorrt", "--prompt", "hi"], "--backend tensorrt: only with --engine-dir"),
    (["generate", "--engine-dir", "{tmp}/e", "--dtype", "float16", "--prompt", "hi"],
     "--dtype and --engine-dir exclude each other"),
    (["generate", "--engine-dir", "{tmp}/e", "--device", "cpu", "--prompt", "hi"],
     "--device and --engine-dir exclude each other"),
    (["generate", "--engine-dir", "{tmp}/e", "--model", "m", "--prompt", "hi"],
     "--model and --engine-dir exclude each other"),
    (["generate", "--prompt-file", "{tmp}/binary.txt"], "--prompt-file {tmp}/binary.txt: not UTF-8 text (byte 128"),
    (["generate", "--prompt-file", "{tmp}/folder"], "--prompt-file {tmp}/folder: is a directory, not a text file"),
    (["generate", "--prompt-file", "{tmp}/none.txt"], "--prompt-file {tmp}/none.txt: no such prompt file"),
])
def test_bad_inputs_give_one_line_naming_the_culprit(tmp_path, capsys, argv, message):
    _files(tmp_path)
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"criticalkv {argv[0]}: error: ")
    assert message.format(tmp=tmp_path) in err


def test_every_command_explains_itself_in_plain_text():
    """Each subcommand's --help has a description, and none shows docstring markup."""
    import argparse

    from criticalkv.cli import build_parser

    def walk(parser, name):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from walk(child, f"{name} {sub}")

    helps = dict(walk(build_parser(), "criticalkv"))
    assert {"criticalkv eval needle", "criticalkv eval ruler", "criticalkv eval perturbation",
            "criticalkv select"} <= set(helps)
    for name, parser in helps.items():
        assert parser.description, name
        text = parser.format_help()
        assert "``" not in text and ":func:" not in text, name
        assert all(action.help for action in parser._actions if action.option_strings), name


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"criticalkv {metadata.version('criticalkv')}"


#: what a command that only parses, lists or refuses its arguments must not load (seconds of imports each)
HEAVY = ("torch", "transformers", "onnxruntime", "onnx", "fastapi", "uvicorn", "tritonclient", "matplotlib")


def _loaded_by(argv, env=None):
    """(exit status, stderr, the HEAVY modules loaded) of `criticalkv ARGV` run in a fresh interpreter."""
    script = ("import json, sys\nfrom criticalkv.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
              "except SystemExit as e:\n    code = e.code\n"
              f"print('LOADED', json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)\n"
              "sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("LOADED "), run.stderr
    return run.returncode, run.stderr, json.loads(last[len("LOADED "):])


@pytest.mark.parametrize("argv, code", [
    (["policies"], 0),
    (["--help"], 0),
    (["serve", "--help"], 0),
    (["bench", "serve", "--help"], 0),
    (["eval", "needle", "--help"], 0),
    (["generate", "--prompt", "hi", "--budget", "0"], 2),
    (["generate", "--prompt", "hi", "--max-new-tokens", "many"], 2),
    (["serve", "--engine-dir", "e", "--http-port", "x"], 2),
    (["eval", "needle", "--out", "o", "--samples", "0"], 2),
    (["bench", "serve", "--engine-dir", "e", "--concurrency", "0"], 2),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_help_listings_and_argument_errors_load_no_torch(argv, code):
    """`criticalkv policies`, --help and argument errors answer at once (each of HEAVY costs seconds to import:
    `policies` took 7.7 s when every subcommand's module imported them)."""
    status, err, loaded = _loaded_by(argv)
    assert status == code and "Traceback" not in err, err
    assert loaded == [], f"criticalkv {' '.join(argv)} loaded {loaded}"


@pytest.fixture(scope="module")
def tiny_engine_dir(tmp_path_factory):
    from serving.servers import build_tiny_engine

    return build_tiny_engine(tmp_path_factory.mktemp("engine"))


def test_a_bad_budget_fails_before_the_engine_loads(tiny_engine_dir):
    status, err, loaded = _loaded_by(["generate", "--engine-dir", str(tiny_engine_dir), "--prompt", "w5", "--budget", "0"])
    assert status == 2 and "serves per-request budgets in [8, 40] only" in err, err
    assert "onnxruntime" not in loaded, loaded


def test_serve_tensorrt_without_tensorrt_engines_fails_before_anything_starts(tiny_engine_dir, tmp_path):
    """The message `generate --backend tensorrt` gives, status 2, no server started (no temporary repository)."""
    status, err, _ = _loaded_by(["serve", "--engine-dir", str(tiny_engine_dir), "--backend", "tensorrt"],
                                env={"TMPDIR": str(tmp_path)})
    assert status == 2, err
    assert f"criticalkv serve: error: {tiny_engine_dir}: no TensorRT engines in this engine directory" in err, err
    assert "Rebuild it with scripts/build_engine.py on a machine with TensorRT 10" in err
    assert "starting tritonserver" not in err and not list(tmp_path.glob("criticalkv-serve-*")), err


def test_serve_names_the_backend_it_picks_when_none_is_given(tiny_engine_dir, tmp_path):
    """Without --backend, `serve` picks OpenVINO where the CPU computes bf16 (runtime.registry.served_backend), else
    ONNX Runtime, and says which and why once nothing stands in the way of the start; a check that stops it first (a
    busy port) stays its one line. Here the start is cut short by --ready-timeout (status 1), and nothing is left."""
    from runtime.test_registry import _cpu_computes_bf16

    from criticalkv.serving.launcher import free_port

    env = {"TMPDIR": str(tmp_path), "CRITICALKV_SERVE_BACKEND": ""}
    ports = [a for flag in ("--http-port", "--grpc-port", "--metrics-port", "--openai-port") for a in (flag, str(free_port()))]
    argv = ["serve", "--engine-dir", str(tiny_engine_dir), *ports, "--threads", "1", "--ready-timeout", "1"]
    status, err, _ = _loaded_by(argv, env=env)
    expected = "openvino" if _cpu_computes_bf16() else "onnxruntime"
    lines = err.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("criticalkv serve: backend ")]
    assert status == 1 and len(said) == 1 and lines[said[0]].startswith(f"criticalkv serve: backend {expected}: "), err
    assert lines[said[0] + 1].startswith("starting tritonserver"), err
    assert not list(tmp_path.glob("criticalkv-serve-*")), err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = ["serve", "--engine-dir", str(tiny_engine_dir), "--http-port", str(busy.getsockname()[1])]
        status, err, loaded = _loaded_by(taken, env={**env, "CRITICALKV_SERVE_BACKEND": "onnxruntime"})
    assert status == 2 and "backend" not in _one_line(err) and "(--http-port) on 127.0.0.1 is already in use" in err, err
    assert "onnxruntime" not in loaded, loaded  # named, not probed


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("LOADED ")]
    assert len(lines) == 1 and "Traceback" not in err and "usage:" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["serve", "--http-port", "99999"],
     "criticalkv serve: error: argument --http-port: 99999 is not a port number: 1-65535 (see criticalkv serve --help)"),
    (["serve", "--openai-port", "-1"], "argument --openai-port: -1 is not a port number: 1-65535 (or 0: not started)"),
    (["serve", "--backend", "nonsense"], "argument --backend: invalid choice: 'nonsense' (choose from"),
    (["serve", "--instances", "0"], "argument --instances: must be >= 1, got 0"),
    (["serve", "--kv-memory-mib", "nan"], "argument --kv-memory-mib/--kv-pool-mib: 'nan' is not a finite number"),
    (["serve", "--gpus", "0,0"], "argument --gpus: '0,0': GPU ids are integers >= 0, each given once"),
    (["serve", "--max-body-bytes", "0"], "argument --max-body-bytes: must be >= 1, got 0"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "argument --max-tokens/--max-new-tokens: must be >= 1, got 0"),
    (["serve", "--write-repo", "models", "--threads", "-2"], "argument --threads: must be >= 0, got -2"),
    (["nonsense"], "criticalkv: error: argument COMMAND: invalid choice: 'nonsense'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_argument_error_is_one_line_naming_it_before_anything_loads(argv, message):
    """No usage block, no traceback: one line with the argument and its range, and where to read more."""
    status, err, loaded = _loaded_by(argv)
    line = _one_line(err)
    assert status == 2 and message in line and line.endswith("--help)"), line
    assert loaded == [], loaded


def test_generate_checks_its_request_against_the_engine_without_loading_it(tiny_engine_dir, tmp_path):
    """--max-tokens beyond the engine's maximum, a prompt longer than its max input length (counted by its tokenizer)
    and an --engine-dir naming a file: one line each, ONNX Runtime never imported (the engine was not loaded)."""
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text(" ".join(["w5"] * 300))
    engine = str(tiny_engine_dir)
    cases = [
        (["--engine-dir", engine, "--prompt", "w5", "--max-tokens", "1000000000"],
         "criticalkv generate: error: --max-tokens: max_tokens must lie in [1, 32] (the engine's built maximum), got "
         "1000000000"),
        (["--engine-dir", engine, "--prompt-file", str(long_prompt), "--max-tokens", "4"],
         "criticalkv generate: error: the prompt has 300 tokens, more than the engine's max input length 256"),
        (["--engine-dir", str(tiny_engine_dir / "manifest.json"), "--prompt", "w5"],
         f"criticalkv generate: error: {tiny_engine_dir / 'manifest.json'} is a file, not an engine directory"),
    ]
    for argv, message in cases:
        status, err, loaded = _loaded_by(["generate", *argv])
        assert status == 2 and _one_line(err).startswith(message), err
        assert "onnxruntime" not in loaded, (argv, loaded)


@pytest.mark.parametrize("argv, message", [
    (["--context-policy", "nonsense"], "--context-policy: context policy 'nonsense': no such policy; this engine serves "
                                      "its own 'criticalkv'"),
    (["--max-num-seqs", "99"], "--max-num-seqs: max_num_seqs 99 exceeds the engine's max batch size 3"),
])
def test_serve_checks_its_options_against_the_engine_before_anything_starts(tiny_engine_dir, tmp_path, argv, message):
    """No server started (no temporary repository, ONNX Runtime never imported), one line naming the real problem
    (a context policy that does not exist is not one to rebuild the engine with)."""
    status, err, loaded = _loaded_by(["serve", "--engine-dir", str(tiny_engine_dir), *argv], env={"TMPDIR": str(tmp_path)})
    line = _one_line(err)
    assert status == 2 and line.startswith(f"criticalkv serve: error: {message}"), line
    assert "rebuild it with --context-policy nonsense" not in line and "onnxruntime" not in loaded
    assert not list(tmp_path.glob("criticalkv-serve-*")), err


def test_every_help_loads_nothing_heavy():
    """--help of every command (and of scripts/build_engine.py) answers at once: none imports torch, transformers,
    ONNX or ONNX Runtime (build_engine.py --help took 10 s when it imported the exporter)."""
    from criticalkv.cli import build_parser

    def commands(parser, prefix):
        yield prefix
        for action in parser._actions:
            if isinstance(action, __import__("argparse")._SubParsersAction):
                for name, child in action.choices.items():
                    yield from commands(child, [*prefix, name])

    every = list(commands(build_parser(), []))
    assert ["serve"] in every and ["eval", "needle"] in every
    script = ("import json, runpy, sys\nfrom criticalkv.cli import main\n"
              f"for argv in {every!r}:\n"
              "    try:\n        main([*argv, '--help'])\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
              f"sys.argv = [{str(Path(criticalkv.__file__).parents[1] / 'scripts' / 'build_engine.py')!r}, '--help']\n"
              "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0\n"
              f"print('LOADED', json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Build an engine directory" in run.stdout and "usage: criticalkv serve" in run.stdout
    assert run.stderr.strip().splitlines()[-1] == "LOADED []", run.stderr[-2000:]


#: where the signal lands: (name, when, what the command has read of its prompt by then); the prompt is a FIFO
#: the command blocks reading, but for "imports", which gets its prompt on the command line and goes on to
#: import torch
MOMENTS = [
    ("python-start-up", "at once", None),  # Python itself starting (its own handlers may not exist yet)
    ("imports", "torch mapped", None),     # inside main(): torch loading (seconds)
    ("fifo-opened", "reader", b""),        # the command has just opened the FIFO: about to block reading it
    ("mid-prompt", "reader", b"The capital of"),  # blocked reading, part of the prompt written, no end yet
    # CI's hang, made certain: the signal is handled by another thread of the process (Python's C handler
    # only notes it) while the main thread blocks reading, as when it lands just before the blocking read
    ("noted-while-blocked", "reader-thread", b""),
]

#: the tgkill system call (a signal to one thread of another process), by machine
TGKILL = {"x86_64": 234, "aarch64": 131}


def _tgkill(pid, sig):
    """Send ``sig`` to a thread of ``pid`` other than its main thread; False if it has none."""
    import ctypes
    import platform

    threads = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    if not threads or platform.machine() not in TGKILL:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(TGKILL[platform.machine()], pid, threads[0], int(sig)) == 0, ctypes.get_errno()
    return True


def _mapped(pid, library):
    try:
        return library in open(f"/proc/{pid}/maps").read()
    except OSError:
        return False


def _as_from_a_terminal():
    """Ctrl-C's default action, as a command started from a shell prompt has it. A test run started in the
    background of a non-interactive shell (``cmd &``, as CI runners may) inherits SIGINT ignored; CPython then
    installs no handler of its own, and a SIGINT landing before criticalkv's first line is discarded by the kernel:
    the command would wait for its prompt, a hang no code of the command can see (met once in such a run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(proc, fifo, when, deadline):
    """Return when the command has reached ``when``: the write end of ``fifo`` for "reader"."""
    while time.monotonic() < deadline and proc.poll() is None:
        if when == "torch mapped" and _mapped(proc.pid, "libtorch"):
            return None
        if when.startswith("reader"):
            try:  # opening the write end succeeds once the command has opened the read end
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as err:
                assert err.errno == errno.ENXIO
        time.sleep(0.002)
    raise AssertionError(f"the command never reached {when!r} (exit status {proc.poll()})")


@pytest.mark.parametrize("sig, code, line", [
    (signal.SIGINT, 130, "criticalkv generate: interrupted"),
    (signal.SIGTERM, 143, "criticalkv generate: terminated (SIGTERM)"),
])
def test_ctrl_c_and_sigterm_end_a_command_with_one_line(tmp_path, sig, code, line):
    """A signal at each moment of a command's start-up, and while it blocks reading its prompt from a FIFO
    (where CI once hung: a signal landing just before the blocking read was never acted on), ends the command
    at once with one line. The commands run side by side: one start-up's time for all."""
    started = []
    for name, when, written in MOMENTS:
        fifo = tmp_path / f"prompt-{name}"
        os.mkfifo(fifo)
        prompt = ["--prompt", "The capital of France is"] if when == "torch mapped" else ["--prompt-file", str(fifo)]
        proc = subprocess.Popen([sys.executable, "-m", "criticalkv.cli", "generate", *prompt],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_terminal)
        started.append((name, when, written, proc, fifo))
    writers = []
    for name, when, written, proc, fifo in started:
        if when != "at once":
            writer = _wait_for(proc, fifo, when, time.monotonic() + 120)
            if writer is not None:
                writers.append(writer)
                if written:
                    os.write(writer, written)
                    time.sleep(0.05)  # the command reads it and blocks again
        if when == "reader-thread":
            time.sleep(0.2)  # blocked in the read by now
            if _tgkill(proc.pid, sig):
                continue
        proc.send_signal(sig)
    results = {}
    for name, _, _, proc, _ in started:
        # 30 s: far beyond the 0.1 s the command needs, yet a hang fails here instead of stalling CI
        out, err = proc.communicate(timeout=30)
        results[name] = (proc.returncode, err.strip(), out)
    for writer in writers:
        os.close(writer)
    for name, (returncode, err, out) in results.items():
        assert out == "", (name, out)
        if name == "python-start-up" and err != line:
            # CPython's own start-up, before any criticalkv code: killed by the signal, or CPython's "Fatal
            # Python error: init_import_site ... KeyboardInterrupt" (status 1); it ended, which is the point
            package = str(Path(criticalkv.__file__).parent)  # no frame of criticalkv's own code
            assert returncode in (-sig, 1) and package not in err, (name, returncode, err)
        else:
            # -SIGINT: CPython ends by SIGINT itself when a KeyboardInterrupt crossed C code that ran Python
            # (pybind11's exec in torch's import) even though criticalkv caught it; shells report 130 for both
            assert err == line and returncode in (code, -sig), (name, returncode, err)
