"""Shared-context evaluation: the documents and questions, the question-aware extension of a document's prefill (the
same as one prefill of document + question), the adaptive budget, the statistics, and the command on a tiny model."""

import json
import math
import re

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.eval.engine import ScoreBank, decode, extend_shared_prefill, select_all_layers, shared_prefill
from criticalkv.eval.shared_context import (
    KINDS,
    build_document,
    continuation_match,
    count_match,
    overlap_f1,
    score_answer,
    shared_documents,
)
from criticalkv.eval.shared_runner import make_runs
from criticalkv.methods.budget import adaptive_budget
from criticalkv.eval.shared_stats import Cells, cluster_mean_ci, lost_at_larger_budget, paired, render, summarize


# ------------------------------------------------------------------------------------------------ documents
def test_a_document_is_one_context_of_exact_length_shared_by_its_questions(tokenizer):
    doc = build_document(tokenizer, "shakespeare", 0, 1500, kinds=tuple(KINDS))
    assert len(doc.context_ids) == 1500
    assert [q.kind for q in doc.questions] == ["key"] * 5 + ["keys", "chain", "owner", "quote", "count", "open"]
    text = tokenizer.decode(doc.context_ids)
    for q in doc.questions:
        assert q.metric == KINDS[q.kind][0] and q.max_new_tokens == KINDS[q.kind][1]
        whole = tokenizer.decode(doc.context_ids + q.ids)
        assert whole.startswith(text) and q.text in whole  # the question follows the context it shares
        if q.kind in ("key", "keys", "chain"):
            for number in q.answers:
                assert len(re.findall(rf"(?<!\d){number}(?!\d)", text)) == 1
        if q.kind == "owner":
            attribute, number = re.fullmatch(r"Question: Whose (.+) is (\d+)\? .*", q.text).groups()
            assert f"The {attribute} of {q.answers[0]} is {number}." in text
    count = next(q for q in doc.questions if q.kind == "count")
    sentence = re.search(r'"(.+)"', count.text).group(1)
    assert text.count(sentence) == int(count.answers[0])
    quote = next(q for q in doc.questions if q.kind == "quote")
    lead = re.search(r'"(.+)"', quote.text).group(1)
    after = text.split(lead, 1)[1]
    assert [w.lower() for w in re.findall(r"[A-Za-z0-9_]+", after)[:3]] == list(quote.answers)


def test_documents_are_the_same_on_every_call_and_the_splits_share_no_text(tokenizer):
    a = shared_documents(tokenizer, ["docs", "code"], 2, [1200, 1400], seed=3)
    b = shared_documents(tokenizer, ["docs", "code"], 2, [1200, 1400], seed=3)
    assert [d.key for d in a] == ["docs/eval/d0", "code/eval/d0", "docs/eval/d1", "code/eval/d1"]
    assert [d.context_ids for d in a] == [d.context_ids for d in b]
    assert [len(d.context_ids) for d in a] == [1200, 1200, 1400, 1400]
    train = shared_documents(tokenizer, ["docs"], 1, [1200], seed=3, split="train")[0]
    evaluation = tokenizer.decode(a[0].context_ids)
    sentences = [s for s in re.split(r"(?<=\.) ", tokenizer.decode(train.context_ids)) if len(s) > 60]
    assert sentences and not any(s in evaluation for s in sentences[5:-5])


def test_a_context_too_short_for_its_facts_is_refused(tokenizer):
    with pytest.raises(ValueError, match="too short"):
        build_document(tokenizer, "legal", 0, 300)


def test_the_scorers():
    assert score_answer("digits", " 4821.", ["4821"]) == 1.0 and score_answer("digits", "48210", ["4821"]) == 0.0
    assert score_answer("all", "4821 and 1234", ["1234", "4821"]) == 1.0
    assert score_answer("all", "4821", ["1234", "4821"]) == 0.5
    assert score_answer("part", " Marian Holt.", ["Marian Holt"]) == 1.0
    assert continuation_match(' upon the credulous world"', ["upon", "the", "credulous"]) == 1.0
    assert continuation_match(" upon a credulous", ["upon", "the", "credulous"]) == 0.0
    assert count_match(" 3 times.", "3") == 1.0 and count_match(" three times", "3") == 1.0
    assert count_match(" 4 times, not 3", "3") == 0.0 and count_match(" often", "3") == 0.0
    assert score_answer("reference", "anything", []) is None
    assert overlap_f1("the text is about plays", "the text is about plays") == 1.0
    assert 0 < overlap_f1("about the plays", "about the poems") < 1 and overlap_f1("x", "y") == 0.0


# ------------------------------------------------------------------------------------------------ the extension
def test_extending_a_prefill_by_a_question_is_one_prefill_of_both(model):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, model.config.vocab_size, (1, 170), generator=g)
    doc, question = ids[:, :150], ids[:, 150:]  # a question shorter than the window: its first queries are the doc's
    whole = shared_prefill(model, ids, [8, 32], keep_hidden=True)
    part = extend_shared_prefill(model, shared_prefill(model, doc, [8, 32], keep_hidden=True), question)
    assert part.n == whole.n == 170 and torch.equal(part.input_ids, whole.input_ids)
    for name in ("keys", "values", "hidden"):
        for a, b in zip(getattr(part, name), getattr(whole, name)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for w in (8, 32):
        for a, b in zip(part.queries[w], whole.queries[w]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(part.logits, whole.logits, rtol=1e-4, atol=1e-4)
    for policy in (KVPolicy("snapkv", budget=40, window=32), KVPolicy("criticalkv", budget=40, window=32),
                   KVPolicy("ada-criticalkv", budget=60, window=8)):
        a = select_all_layers(policy, ScoreBank(part))
        b = select_all_layers(policy, ScoreBank(whole))
        assert all(torch.equal(x.indices, y.indices) for x, y in zip(a, b))
        assert decode(model, part, a, 8).tokens == decode(model, whole, b, 8).tokens


def test_the_extension_needs_the_window_queries_it_reaches_back_for(model):
    ids = torch.randint(2, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(6))
    prefill = shared_prefill(model, ids[:, :110], [8])
    with pytest.raises(ValueError, match="window 32"):
        extend_shared_prefill(model, prefill, ids[:, 110:], windows=[32])
    with pytest.raises(ValueError, match=r"\[1, q\]"):
        extend_shared_prefill(model, prefill, ids[:, :0])


# ------------------------------------------------------------------------------------------------ adaptive budget
def test_the_adaptive_budget_keeps_what_scores_above_the_threshold_at_most_the_cap():
    n, w = 100, 8
    scores = [torch.zeros(1, 2, n) for _ in range(3)]
    scores[0][0, 0, :30] = 0.5  # 30 older entries of 6 heads above 0.1
    scores[1][0, 1, 10:20] = 0.05
    assert adaptive_budget(scores, 0.1, w, cap=50) == w + math.ceil(30 / 6)
    assert adaptive_budget(scores, 0.01, w, cap=50) == w + math.ceil(40 / 6)
    assert adaptive_budget(scores, 0.01, w, cap=12) == 12
    assert adaptive_budget(scores, 0.9, w, cap=50) == w  # nothing above: the window alone
    scores[2][0, 0, n - w:] = 1.0  # the window's own entries are kept anyway: not counted
    assert adaptive_budget(scores, 0.9, w, cap=50) == w
    with pytest.raises(ValueError, match="threshold"):
        adaptive_budget(scores, 0.0, w, cap=50)


def test_runs_name_their_budget_rule():
    base = KVPolicy("full")
    runs = make_runs("agnostic", ["full", "snapkv"], [0.125, 0.5], base)
    assert [r.key for r in runs] == ["full", "snapkv@12.5%", "snapkv@50%"]
    assert runs[1].budget(2048) == 256 and runs[2].budget(2049) == 1025
    adaptive = make_runs("agnostic", ["layer-kvzip"], [0.5], base, thresholds=[0.01])
    assert [r.key for r in adaptive] == ["layer-kvzip@t0.01<=50%"]
    with pytest.raises(ValueError, match="no score of its own"):
        make_runs("agnostic", ["snapkv"], [0.5], base, thresholds=[0.01])
    with pytest.raises(ValueError, match="fraction"):
        make_runs("agnostic", ["snapkv"], [1.5], base)


# ------------------------------------------------------------------------------------------------ statistics
def _records(scores_a, scores_b, docs):
    out = []
    for i, (a, b) in enumerate(zip(scores_a, scores_b)):
        for run, s in (("p@25%", a), ("q@25%", b)):
            out.append({"doc": f"d{docs[i]}", "question": f"d{docs[i]}/q{i}", "kind": "key", "domain": "x",
                        "setting": "agnostic", "run": run, "score": s, "kept": 0.25, "budget": 1, "n": 4,
                        "exact": s == 1.0, "agree": s, "kl": 1 - s, "text": str(s), "tokens": []})
    return out


def test_the_cluster_bootstrap_resamples_documents():
    # two documents, each all right or all wrong: the interval spans what resampling the documents gives (0 to 1),
    # wider than resampling 40 questions independently would
    values = {f"d{d}/q{i}": float(d) for d in (0, 1) for i in range(20)}
    doc_of = {q: q.split("/")[0] for q in values}
    mean, lo, hi, n = cluster_mean_ci(values, doc_of)
    assert (mean, n) == (0.5, 40) and lo == 0.0 and hi == 1.0
    same = {q: 1.0 for q in values}
    assert cluster_mean_ci(same, doc_of)[:3] == (1.0, 1.0, 1.0)


def test_paired_differences_and_lost_answers():
    # 10 documents of 4 questions; a wins 10 questions spread over 8 of them (2, 2, then 1 each), loses none: the
    # interval lies above 0 (a resample without a won question has probability 0.2^10) and spans 0.25
    won = {0, 1, 4, 5, 8, 12, 16, 20, 24, 28}
    a = [1.0] * 40
    b = [0.0 if i in won else 1.0 for i in range(40)]
    records = _records(a, b, [i // 4 for i in range(40)])
    cells = Cells(records)
    p = paired(cells.scored(("agnostic", "p@25%")), cells.scored(("agnostic", "q@25%")), cells.doc_of)
    assert p["n"] == 40 and p["mean_diff"] == pytest.approx(0.25) and (p["wins"], p["losses"]) == (10, 0)
    assert 0 < p["ci95"][0] < 0.25 < p["ci95"][1]
    # p at 12.5 % answers what q at 25 % loses: "p@" and "q@" as two budgets of one policy
    for r in records:
        r["run"] = "pol@12.5%" if r["run"] == "p@25%" else "pol@25%"
    lost = lost_at_larger_budget(Cells(records), "agnostic", "pol", {0.125: "pol@12.5%", 0.25: "pol@25%"})
    assert lost["lost"] == 10 and lost["of"] == 40


def test_tables_come_from_the_records():
    records = _records([1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    for r in list(records):
        if r["run"] == "p@25%":
            records.append({**r, "run": "full", "exact": None})
    for r in records:
        if r["run"] == "full":
            del r["exact"], r["agree"], r["kl"]
    summary = summarize(Cells(records))
    rows = summary["settings"]["agnostic"]["rows"]
    assert list(rows) == ["full", "p", "q"]
    assert rows["p"]["cells"]["0.25"]["accuracy"][0] == 0.75 and rows["q"]["cells"]["0.25"]["accuracy"][0] == 0.5
    text = render(summary, {})
    assert "| `p` | 75.0 [" in text and "| `q` | 50.0 [" in text
    json.dumps(summary)  # summary.json


# ------------------------------------------------------------------------------------------------ the command
def test_the_command_on_a_tiny_model_writes_records_resumes_and_draws_tables(model_dir, tmp_path, capsys):
    from criticalkv.cli import main

    out = tmp_path / "shared"
    argv = ["eval", "shared-context", "--model", str(model_dir), "--domains", "shakespeare,code", "--documents", "1",
            "--lengths", "900", "--kinds", "key,quote,open", "--fractions", "0.25,0.5", "--policies",
            "full,snapkv,layer-kvzip-criticalkv:head_cap_ratio=3", "--aware-policies", "criticalkv",
            "--adaptive", "layer-kvzip-criticalkv:head_cap_ratio=3", "--thresholds", "0.01",
            "--adaptive-caps", "0.5", "--window", "8", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    questions = 2 * (5 + 1 + 1)
    # full + 2 fixed policies x 2 budgets + 1 adaptive (agnostic), 1 policy x 2 budgets (aware)
    assert len(records) == questions * (1 + 4 + 1 + 2)
    assert {r["setting"] for r in records} == {"agnostic", "aware"}
    assert all("kl" in r and r["kl"] >= -1e-9 for r in records if r["run"] != "full")
    assert all(r["exact"] == (r["agree"] == 1.0) or r["kind"] == "open" or not r["exact"]
               for r in records if r["run"] != "full")
    adaptive = [r for r in records if "<=" in r["run"]]
    assert adaptive and all(8 <= r["budget"] <= math.ceil(0.5 * r["n"]) for r in adaptive)
    table = (out / "tables.md").read_text()
    assert "Question-agnostic" in table and "Question-aware" in table and "Adaptive budget" in table
    # nothing left to do: --resume finds every document done; without it, the results are refused
    assert main(argv + ["--resume"]) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == len(records)
    assert main(argv) == 2 and "already holds shared-context results" in capsys.readouterr().err
    # a run stopped inside a document: its partial records are dropped and the document redone
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    docs = (out / "documents.jsonl").read_text().splitlines(keepends=True)
    (out / "documents.jsonl").write_text(docs[0])
    (out / "records.jsonl").write_text("".join(lines[:-3]) + lines[-3][:20])
    assert main(argv + ["--resume"]) == 0
    again = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert sorted((r["question"], r["setting"], r["run"], r["text"]) for r in again) == sorted(
        (r["question"], r["setting"], r["run"], r["text"]) for r in records)
    assert main(["eval", "report", str(out)]) == 0 and "tables.md" in capsys.readouterr().out
    # a narrower resume (fewer runs): the documents done keep all their runs, the ones still to do get the fewer runs
    (out / "documents.jsonl").write_text(docs[0])
    narrow = list(argv)
    narrow[narrow.index("--policies") + 1] = "full,snapkv"
    assert main(narrow + ["--resume"]) == 0
    resized = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    first, second = json.loads(docs[0])["doc"], json.loads(docs[1])["doc"]
    assert [r for r in resized if r["doc"] == first] == [r for r in again if r["doc"] == first]
    assert {r["run"] for r in resized if r["doc"] == second} == {r["run"] for r in again} - {
        r["run"] for r in again if r["policy"] == "layer-kvzip-criticalkv:head_cap_ratio=3" and r["threshold"] is None}
    meta = json.loads((out / "config.json").read_text())
    assert meta["earlier_commands"] and "layer-kvzip-criticalkv:head_cap_ratio=3" in meta["earlier_commands"][0]
    assert "full,snapkv" in meta["command"]
    assert "full,snapkv" in (out / "tables.md").read_text()  # every command behind the records
    # a resume with a run the folder never had is refused
    wider = list(argv)
    wider[wider.index("--policies") + 1] = "full,snapkv,layer-kvzip"
    capsys.readouterr()
    assert main(wider + ["--resume"]) == 2 and "another configuration" in capsys.readouterr().err


def test_the_command_refuses_bad_input_before_loading_a_model(tmp_path, capsys):
    from criticalkv.cli import main

    base = ["eval", "shared-context", "--out", str(tmp_path / "x")]
    for extra, message in ((["--domains", "poetry"], "unknown poetry"), (["--fractions", "0.25,2"], "fraction"),
                           (["--kinds", "riddle"], "unknown riddle"), (["--documents", "0"], ">= 1"),
                           (["--policies", "snapkv", "--thresholds", "0.1", "--adaptive", "snapkv"], "no score")):
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


def test_a_run_recorded_with_every_knob_resumes(tmp_path):
    """A folder written before the knobs moved to the methods holds each run's policy with every knob
    (``KVPolicy.attributes()``); --resume with today's form of the same policies goes on, another policy is refused."""
    import json as _json

    from criticalkv.eval import shared_runner as sr
    from criticalkv.eval.shared_command import _check_earlier
    from criticalkv.policy import parse_policy_spec

    policy = parse_policy_spec("layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6", KVPolicy())
    assert set(policy.attributes()) > set(policy.to_dict())  # the old form lists knobs the method does not read
    old = {"task": "shared-context", "runs": [["agnostic", "x@25%", policy.attributes()]]}
    (tmp_path / sr.CONFIG).write_text(_json.dumps({"config": old}))
    (tmp_path / sr.RECORDS).write_text("")
    _check_earlier(tmp_path, {"task": "shared-context", "runs": [["agnostic", "x@25%", policy.to_dict()]]},
                   resume=True, overwrite=False)
    other = parse_policy_spec("snapkv", KVPolicy()).to_dict()
    with pytest.raises(ValueError, match="another configuration"):
        _check_earlier(tmp_path, {"task": "shared-context", "runs": [["agnostic", "x@25%", other]]},
                       resume=True, overwrite=False)
