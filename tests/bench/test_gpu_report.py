"""``criticalkv bench gpu-serve``'s report renders whatever the run measured: a figure that is missing (a step that
failed, a policy that did not fit, a run cut by its time limit) shows as "-" or "not measured", never a crash that
hides the run's real outcome."""

from criticalkv.bench.gpu_report import check_targets, render


def measured_run() -> dict:
    def served(c, tokens_per_s, tpot):
        return {"concurrency": c, "completed": True, "finished": 8, "requests": 8, "output_throughput": tokens_per_s,
                "ttft_ms": {"p50": 10.0, "p90": 12.0, "p99": 13.0}, "tpot_ms": {"p50": tpot, "p90": tpot, "p99": tpot},
                "itl_ms": {"p50": tpot, "p90": tpot, "p99": tpot}}

    return {
        "gpu": {"name": "NVIDIA H100", "memory_gib": 79.6},
        "workload": {"prompt_lengths": [8192, 32768], "concurrency": [1, 8, 32], "budget": 2048, "kv_memory_gib": 40,
                     "new_tokens": 256, "question_tokens": 32},
        "model": {"name": "llama-8b-shaped", "parameters": 8.0e9, "dtype": "bfloat16"},
        "copy_bandwidth_bytes_per_s": 3.0e12, "weights_bytes_per_step": 16e9, "elapsed_s": 250.0,
        "runs": [
            {"name": "full", "policy": "full", "prompt_tokens": 32768, "rows": 4, "selection_kernels": "-",
             "cold": {"ttft_s": 2.0, "prefill_s": 2.0, "selection_s": None}, "served": [served(32, 100.0, 20.0)]},
            {"name": "criticalkv", "policy": "criticalkv", "prompt_tokens": 32768, "rows": 32, "selection_kernels": "cuda",
             "cold": {"ttft_s": 2.05, "prefill_s": 2.0, "selection_s": 0.03},
             "served": [served(1, 50.0, 8.0), served(32, 400.0, 9.0)],
             "step": {"batch": 32, "step_s": 0.009, "decode_call_s": 0.0095, "floor_s": 0.008, "floor_ratio": 1.125,
                      "read_floor_s": 0.0085}},
        ],
        "kvpress": [{"prompt_tokens": 32768, "press": "CriticalKVPress", "ttft_s": 5.0, "decode_tokens_per_s": 20.0,
                     "kept_tokens_per_head": 2048}],
        "skipped": [],
    }


def test_targets_and_report_of_a_measured_run():
    results = measured_run()
    targets = {t["target"].split(" at ")[0].split(",")[0]: t for t in check_targets(results)}
    assert abs(targets["TTFT"]["value"] - 2.05 / 2.0) < 1e-12 and targets["TTFT"]["met"] is True
    assert targets["output tokens/s"]["value"] == 4.0 and targets["output tokens/s"]["met"] is True
    assert targets["decode step"]["value"] == 1.125 and targets["decode step"]["met"] is True
    assert abs(targets["TTFT criticalkv / kvpress"]["value"] - 0.41) < 1e-12
    assert targets["decode tokens/s"]["value"] == (1e3 / 8.0) / 20.0
    results["targets"] = check_targets(results)
    text = render(results)
    assert "| 32768 | criticalkv | 32 | 2.050 | 1.025 | 2.000 | 0.030 | cuda |" in text
    assert "| 32768 | criticalkv | 32 | 32 | 8/8 | 10.0/12.0/13.0 | 9.0/9.0/9.0 | 9.0/9.0/9.0 | 400.0 | 4.00 |" in text
    assert "3000 GB/s" in text and "8.00 B parameters" in text


def test_a_run_with_missing_figures_still_renders():
    results = measured_run()
    results["copy_bandwidth_bytes_per_s"] = None
    results["model"]["parameters"] = None
    del results["weights_bytes_per_step"]
    crit = results["runs"][1]
    crit["cold"]["ttft_s"] = None
    crit["step"] = {"batch": 32, "step_s": None, "floor_ratio": None}
    crit["served"][1]["output_throughput"] = None
    results["runs"][0]["cold"] = None
    results["runs"][0]["error"] = "CUDA out of memory"
    results["kvpress"] = [{"prompt_tokens": 32768, "error": "kvpress is not installed"}]
    results["errors"] = ["bench step timed out"]
    results["targets"] = check_targets(results)
    assert all(t["value"] is None and t["met"] is None for t in results["targets"])
    text = render(results)
    assert "not measured" in text and "copy bandwidth - GB/s" in text and "- B parameters" in text
    assert "CUDA out of memory" in text and "kvpress is not installed" in text and "bench step timed out" in text


def test_a_run_that_stopped_before_measuring_anything_still_renders():
    text = render({"workload": {}, "runs": [], "targets": check_targets({"workload": {}, "runs": []})})
    assert "## Targets" in text and "GPU: none" in text
