"""``criticalkv eval`` end to end on a tiny random Llama saved as a folder, and its error messages."""

import json
import subprocess
import sys

import pytest

from criticalkv.cli import main

COMMON = ["--window", "8", "--samples", "1", "--threads", "1"]


def read(path):
    return json.loads(path.read_text())


def no_temp_files(folder):
    return not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_needle_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "needle"
    policies = "full,snapkv,criticalkv,criticalkv:stage2_scores=raw"
    assert main(["eval", "needle", "--model", str(model_dir), "--lengths", "300,400", "--depths", "0,100",
                 "--policies", policies, "--budgets", "48,64", "--verify", "1", "--out", str(out), *COMMON]) == 0
    assert "needle: 4 prompts x 7 runs" in capsys.readouterr().out
    doc = read(out / "needle.json")
    assert doc["complete"] and doc["command"].startswith("criticalkv eval needle --policies " + policies)
    assert doc["config"]["runs"]["criticalkv:stage2_scores=raw@64"]["policy"]["stage2_scores"] == "raw"
    assert doc["config"]["runs"]["criticalkv@48"]["policy"] == {**doc["config"]["runs"]["criticalkv@48"]["policy"],
                                                                "budget": 48, "window": 8, "stage2_scores": "pooled"}
    assert doc["environment"]["torch"] and doc["model"]["layers"] == 2 and doc["wall_s"] > 0
    assert set(doc["timing"]["runs"]) == {"full", "snapkv@48", "snapkv@64", "criticalkv@48", "criticalkv@64",
                                          "criticalkv:stage2_scores=raw@48", "criticalkv:stage2_scores=raw@64"}
    assert len(doc["records"]) == 4
    assert [("verified" in r["results"]["criticalkv@48"]) for r in doc["records"]] == [True, False, True, False]
    assert doc["records"][0]["results"]["full"]["needle_kept"] == [1.0]
    for rec in doc["records"]:
        for res in rec["results"].values():
            assert res["score"] in (0.0, 1.0) and 0 < res["kept_fraction"] <= 1
    assert doc["records"][0]["results"]["full"]["kept_fraction"] == 1
    assert {(p["variant"], p["base"]) for p in doc["pairs"]} == {
        ("criticalkv@48", "snapkv@48"), ("criticalkv@64", "snapkv@64"),
        ("criticalkv:stage2_scores=raw@48", "snapkv@48"), ("criticalkv:stage2_scores=raw@64", "snapkv@64")}
    assert set(doc["grid"]["snapkv@48"]) == {"300", "400"} and set(doc["grid"]["snapkv@48"]["300"]) == {"0", "100"}
    assert (out / "needle_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert "| `criticalkv` |" in (out / "needle.md").read_text()
    assert no_temp_files(out)

    # `eval report` recomputes the summaries from the stored per-prompt scores and redraws: same results
    md = (out / "needle.md").read_text()
    (out / "needle.md").unlink()
    (out / "needle_heatmap.png").unlink()
    assert main(["eval", "report", str(out)]) == 0
    assert (out / "needle.md").read_text() == md
    assert (out / "needle_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    again = read(out / "needle.json")
    assert {k: again[k] for k in ("scores", "pairs", "grid")} == {k: doc[k] for k in ("scores", "pairs", "grid")}
    # ... and a changed per-prompt score reaches the summaries
    again["records"][0]["results"]["snapkv@48"]["score"] = 1.0 - again["records"][0]["results"]["snapkv@48"]["score"]
    (out / "needle.json").write_text(json.dumps(again))
    assert main(["eval", "report", str(out / "needle.json")]) == 0
    assert read(out / "needle.json")["scores"]["snapkv@48"] != doc["scores"]["snapkv@48"]
    assert no_temp_files(out)


def test_needle_question_agnostic(model_dir, tmp_path):
    # the haystack compressed without the question, then asked (re-checked against criticalkv.hf.generate with
    # question_ids by --verify); the configuration records the mode, so a question-aware run cannot resume it
    out = tmp_path / "needle"
    args = ["eval", "needle", "--model", str(model_dir), "--lengths", "300", "--depths", "0,100", "--policies",
            "full,criticalkv", "--budgets", "48", "--verify", "2", "--question-agnostic", "--out", str(out), *COMMON]
    assert main(args) == 0
    doc = read(out / "needle.json")
    assert doc["complete"] and doc["config"]["question_agnostic"] is True and "--question-agnostic" in doc["command"]
    assert all("verified" in r["results"]["criticalkv@48"] for r in doc["records"])
    span = doc["records"][0]["meta"]["context_span"]
    # kept fractions count the context only: full keeps all of it
    assert doc["records"][0]["results"]["full"]["kept_fraction"] == 1 and span[1] < 300
    assert main([a for a in args if a != "--question-agnostic"] + ["--resume"]) == 2


def test_needle_runs_the_defensive_policies(model_dir, tmp_path):
    """defensivekv and layer-defensivekv (budget shared across layers) through the evaluation, re-checked against
    criticalkv.hf.generate on the prompt (--verify)."""
    out = tmp_path / "needle"
    policies = "ada-criticalkv,defensivekv,layer-defensivekv"
    assert main(["eval", "needle", "--model", str(model_dir), "--lengths", "300", "--depths", "50",
                 "--policies", policies, "--budgets", "48", "--verify", "1", "--out", str(out), *COMMON]) == 0
    doc = read(out / "needle.json")
    assert doc["complete"] and len(doc["records"]) == 1
    results = doc["records"][0]["results"]
    for run in ("defensivekv@48", "layer-defensivekv@48"):
        assert "verified" in results[run] and results[run]["score"] in (0.0, 1.0)
        assert 0 < results[run]["kept_fraction"] < 1
    assert doc["config"]["runs"]["defensivekv@48"]["policy"]["stage1_mass"] == 0.9
    pert = tmp_path / "pert"
    assert main(["eval", "perturbation", "--model", str(model_dir), "--lengths", "300", "--prompts", "needle",
                 "--depths", "50", "--policies", policies, "--budgets", "48", "--out", str(pert), *COMMON]) == 0
    results = read(pert / "perturbation.json")["records"][0]["results"]
    assert {"adakv@48", "ada-criticalkv@48", "defensivekv@48", "layer-defensivekv@48"} <= set(results)


def test_ruler_end_to_end_and_resume(model_dir, tmp_path):
    out = tmp_path / "ruler"
    args = ["eval", "ruler", "--model", str(model_dir), "--lengths", "1500", "--tasks", "niah_multivalue,cwe,qa",
            "--policies", "adakv,ada-criticalkv", "--budgets", "64", "--out", str(out), *COMMON]
    assert main(args) == 0
    first = read(out / "ruler.json")
    assert [r["task"] for r in first["records"]] == ["niah_multivalue", "cwe", "qa"]
    assert set(first["tasks"]["ada-criticalkv@64"]["tasks"]) == {"niah_multivalue", "cwe", "qa"}
    assert first["pairs"][0]["variant"] == "ada-criticalkv@64" and first["pairs"][0]["base"] == "adakv@64"
    assert (out / "ruler.png").read_bytes()[:4] == b"\x89PNG"
    assert main(args + ["--resume"]) == 0  # nothing recomputed: the per-prompt timings are the stored ones
    again = read(out / "ruler.json")
    assert [r["prefill_s"] for r in again["records"]] == [r["prefill_s"] for r in first["records"]]
    assert no_temp_files(out)


def test_perturbation_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "pert"
    assert main(["eval", "perturbation", "--model", str(model_dir), "--lengths", "300", "--prompts", "needle",
                 "--depths", "20,80", "--policies", "criticalkv,criticalkv:stage2_scores=raw", "--budgets", "40",
                 "--out", str(out), *COMMON]) == 0
    assert "adding snapkv@40" in capsys.readouterr().err
    doc = read(out / "perturbation.json")
    pairs = doc["perturbation"]["all"]["pairs"]
    assert {p["stage2_scores"] for p in pairs} == {"pooled", "raw"}
    for p in pairs:
        assert p["base"] == "snapkv@40" and 0 <= p["frac_heads_lower"] <= 1 and p["heads"] == 2 * 6
        assert 0 <= p["sigma_above_half"] <= 1 and p["prompts"] == 2
    runs = doc["perturbation"]["all"]["runs"]
    assert len(runs["snapkv@40"]["head_l1_mean"]) == 2 and len(runs["snapkv@40"]["layer_l1_mean"]) == 2
    assert "300" in doc["perturbation"]
    for name in ("perturbation_heads.png", "perturbation_layers.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "Fraction of heads" in (out / "perturbation.md").read_text()
    md = (out / "perturbation.md").read_text()
    for name in ("perturbation.md", "perturbation_heads.png", "perturbation_layers.png"):
        (out / name).unlink()
    assert main(["eval", "report", str(out)]) == 0
    assert (out / "perturbation.md").read_text() == md and (out / "perturbation_heads.png").is_file()
    assert read(out / "perturbation.json") == doc


def test_report_refuses_what_it_cannot_redraw(tmp_path, capsys):
    assert main(["eval", "report", str(tmp_path)]) == 2
    assert "no needle.json, ruler.json or perturbation.json" in capsys.readouterr().err
    assert main(["eval", "report", str(tmp_path / "ruler.json")]) == 2
    assert "no such results file" in capsys.readouterr().err
    (tmp_path / "ruler.json").write_text("{not json")
    assert main(["eval", "report", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    (tmp_path / "ruler.json").write_text(json.dumps({"task": "ruler", "config": {}, "complete": False,
                                                      "records": [{}], "prompt_count": 6}))
    assert main(["eval", "report", str(tmp_path)]) == 2
    assert "not complete (1 of 6 prompts done); finish it with --resume" in capsys.readouterr().err
    (tmp_path / "ruler.json").write_text(json.dumps({"name": "criticalkv"}))
    assert main(["eval", "report", str(tmp_path)]) == 2
    assert "not a criticalkv eval results file" in capsys.readouterr().err


def test_a_length_too_short_for_the_task_is_named(model_dir, tmp_path, capsys):
    assert main(["eval", "needle", "--model", str(model_dir), "--lengths", "40", "--budgets", "16", "--depths", "50",
                 "--policies", "snapkv", "--out", str(tmp_path), *COMMON]) == 2
    assert "needle: a 40-token prompt is too short" in capsys.readouterr().err


@pytest.mark.parametrize(
    "task, args, message",
    [
        ("needle", ["--policies", "snapkv,nope"], "unknown KV policy 'nope'"),
        ("needle", ["--policies", "criticalkv:alpha"], "is not knob=value"),
        ("needle", ["--policies", "criticalkv:foo=1"], "unknown knob 'foo'"),
        ("needle", ["--policies", "criticalkv:alpha=x"], "alpha='x' is not a valid float"),
        ("needle", ["--policies", "criticalkv:alpha=2"], "alpha: must lie in [0, 1]"),
        ("needle", ["--policies", ""], "give at least one policy"),
        ("needle", ["--budgets", ""], "--budgets: give at least one value"),
        ("needle", ["--budgets", "64,x"], "'x' is not a valid int"),
        ("needle", ["--budgets", "16"], "smaller than the window"),
        ("needle", ["--lengths", "20"], "20 is not longer than the window (32 tokens)"),
        ("needle", ["--lengths", "100", "--budgets", "128"], "nothing would be evicted"),
        ("needle", ["--kv-policy", "snapkv"], "use --policies and --budgets"),
        ("needle", ["--samples", "0"], "--samples must be >= 1"),
        ("needle", ["--depths", "50,150"], "150 is outside [0, 100]"),
        ("ruler", ["--tasks", "niah_single,nope"], "unknown task(s) nope"),
        ("perturbation", ["--policies", "snapkv,adakv"], "needs at least one CriticalKV policy"),
        ("perturbation", ["--resume"], "not supported by the perturbation analysis"),
    ],
)
def test_bad_inputs_give_clear_errors(tmp_path, capsys, task, args, message):
    assert main(["eval", task, "--out", str(tmp_path / "out"), "--lengths", "2048", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("criticalkv eval: error:") and message in err


@pytest.mark.parametrize(
    "task, stored, args, message",
    [
        ("needle", {"complete": True}, [], "already holds results (complete); pass --resume to continue them"),
        ("ruler", {"complete": False, "prompt_count": 6}, [], "(partial: 1 of 6 prompts); pass --resume"),
        ("perturbation", {"complete": True}, [], "already holds results (complete); pass --overwrite"),
        ("needle", {"complete": True}, ["--resume"],
         "holds results (complete) of another configuration (differs in: chat, depths, lengths"),
        ("needle", "{not json", ["--resume"], "holds results that cannot be read"),
        ("needle", {"complete": True}, ["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        ("needle", {"complete": True}, ["--overwrite"], "no such model folder"),  # replaced: the run goes on
    ],
)
def test_earlier_results_are_never_replaced_silently(tmp_path, capsys, task, stored, args, message):
    out = tmp_path / "out"
    out.mkdir()
    text = stored if isinstance(stored, str) else json.dumps(
        {"task": task, "config": {"task": task, "lengths": [999], "model": "other"},
         "records": [{"key": "p0", "results": {}}], **stored})
    (out / f"{task}.json").write_text(text)
    assert main(["eval", task, "--out", str(out), "--lengths", "2048", "--model", str(tmp_path / "none"), *args]) == 2
    assert message in capsys.readouterr().err
    assert (out / f"{task}.json").read_text() == text


def test_ctrl_c_ends_an_eval_with_one_line_and_its_results_so_far(model_dir, tmp_path):
    import signal
    import time

    out = tmp_path / "needle"
    proc = subprocess.Popen(
        [sys.executable, "-m", "criticalkv.cli", "eval", "needle", "--model", str(model_dir), "--lengths", "300",
         "--depths", "0,25,50,75,100", "--samples", "20", "--policies", "snapkv", "--budgets", "48", "--window", "8",
         "--threads", "1", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "needle.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"criticalkv eval: interrupted; the prompts finished so far are in "
                                            f"{out / 'needle.json'} (continue with --resume)")
    assert "Traceback" not in err
    doc = read(out / "needle.json")
    assert doc["complete"] is False and 1 <= len(doc["records"]) < 100


def test_a_log_gets_one_line_per_prompt_and_no_bars(model_dir, tmp_path, capsys):
    """Standard error is not a terminal here: no carriage-return bars (ours or transformers' weight loading)."""
    args = ["eval", "needle", "--model", str(model_dir), "--lengths", "300", "--depths", "0,100", "--policies",
            "snapkv", "--budgets", "48", "--window", "8", "--samples", "1", "--threads", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "Loading weights" not in err
    assert [line.split(" (")[0] for line in err.splitlines() if line.startswith("eval: ")] == ["eval: 1/2 prompts",
                                                                                               "eval: 2/2 prompts"]
    assert main([*args, "--overwrite"]) == 0
    replacing = f"criticalkv eval: replacing {tmp_path / 'needle.json'} (--overwrite)"
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if not line.startswith("eval: ")] == [replacing] and len(err) == 3


def test_unwritable_out_dir_is_refused(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["eval", "needle", "--out", str(blocker / "sub")]) == 2
    assert "cannot write results there" in capsys.readouterr().err


def test_unknown_task_and_no_traceback(tmp_path):
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "eval", "haystack", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice: 'haystack'" in run.stderr
    run = subprocess.run([sys.executable, "-m", "criticalkv.cli", "eval", "ruler", "--policies", "snap",
                          "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "unknown KV policy 'snap'" in run.stderr and "Traceback" not in run.stderr


def test_results_name_the_model_folder_without_the_home_directory(monkeypatch, tmp_path):
    from pathlib import Path

    from criticalkv.commands.eval import _portable

    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path))
    assert _portable(tmp_path / ".cache" / "criticalkv" / "m") == str(Path("~/.cache/criticalkv/m"))
    assert _portable("/opt/models/m") == "/opt/models/m"
