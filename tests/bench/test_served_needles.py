"""``benchmarks.served_needles``'s table from a results dict (the servers' part runs in results/served_needles)."""

from benchmarks.served_needles import parse_args, render


def test_the_table_counts_needles_and_answers_equal_to_the_first_backend():
    prompts = [{"key": f"needle/legal/L2048/s0/d{d}", "answers": ["1370"],
                "by_backend": {"onnxruntime": {"text": t, "score": s}, "torch": {"text": u, "score": v}}}
               for d, t, s, u, v in ((10, " 1370.", 1.0, " 1370.", 1.0), (50, " no | idea", 0.0, " 1370.", 1.0))]
    results = {"command": "python -m benchmarks.served_needles", "engine": {"label": "criticalkv b=256",
               "engine_dir": "engines/e"}, "domain": "legal", "backends": ["onnxruntime", "torch"], "prompts": prompts,
               "summary": {"onnxruntime": {"found": 1.0, "prompts": 2, "same_text_as_onnxruntime": 2},
                           "torch": {"found": 2.0, "prompts": 2, "same_text_as_onnxruntime": 1}}}
    text = render(results)
    assert "| onnxruntime | 1 of 2 | 2 of 2 |" in text and "| torch | 2 of 2 | 1 of 2 |" in text
    assert "' no \\| idea' (0)" in text  # a | in an answer does not break the row


def test_the_defaults_are_issue_39s_grid():
    args = parse_args(["--engine-dir", "e", "--out", "o"])
    assert (args.lengths, args.depths, args.samples, args.backends) == ("2048", "10,50,90", 3, "onnxruntime,torch")
