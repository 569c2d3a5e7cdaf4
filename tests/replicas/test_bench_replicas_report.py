"""``python -m benchmarks.replicas``'s ratios, targets and table from a results dict (no server): the issue's goals are
judged on the right configurations, and a configuration that failed shows as failed without breaking the report."""

from benchmarks.replicas import TARGET_HIT_VS_POW2, ratios, render, targets


def run(config, label, hit_rate, tokens_per_s, router="pow2"):
    summary = {"completed": 128, "failed": 0, "output_throughput": tokens_per_s, "duration_s": 100.0,
               "ttft_ms": {"p50": 500.0, "p90": 900.0}}
    docqa = {"hit_rate": hit_rate, "local_hit_rate": hit_rate, "store_loads": 0, "compressions": 10,
             "ttft_ms_hit": {"p50": 400.0}, "ttft_ms_miss": {"p50": 5000.0}}
    return {"config": config, "label": label, "router": router, "summary": summary, "docqa": docqa,
            "per_replica": [{"requests": 128}], "router_decisions": {"affinity": 100, "no_holder": 16, "imbalanced": 2},
            "load_average_before": [1.0], "load_average_after": [1.2]}


def results(*runs):
    out = {"command": "python -m benchmarks.replicas ...", "machine": {"cpu": "cpu", "logical_cpus": 2,
                                                                     "load_average_start": [1.0]},
           "versions": {}, "commit": "c", "settings": {"docs": 16, "isl": 2048, "questions": 8, "question_tokens": 32,
                                                       "seed": 0, "concurrency": 8, "osl": 64, "memory_flags": [],
                                                       "prefill_chunk": 512, "threads": 1, "replicas": 2},
           "runs": list(runs)}
    out["ratios"] = ratios(out)
    return out


def test_targets_compare_affinity_with_one_replica_and_power_of_two():
    r = results(run("single", "1 replica", 0.4, 10.0), run("pow2", "2 replicas, power of two", 0.5, 15.0),
                run("affinity", "2 replicas, affinity + store", 0.86, 24.0, router="affinity"))
    assert r["ratios"]["affinity/single:hit"] == 0.86 / 0.4 and r["ratios"]["affinity/pow2:tokens"] == 24.0 / 15.0
    judged = {what: met for what, _, _, met in targets(r)}
    assert judged["hit rate, affinity + store / 1 replica"] is True
    assert judged["hit rate, affinity + store / power of two"] is (0.86 / 0.5 >= TARGET_HIT_VS_POW2)
    assert judged["output tokens/s, affinity + store / power of two"] is True
    missed = results(run("pow2", "p", 0.62, 15.0), run("affinity", "a", 0.867, 14.0, router="affinity"))
    judged = {what: met for what, _, _, met in targets(missed)}
    assert judged["hit rate, affinity + store / power of two"] is False  # 1.40x
    assert judged["output tokens/s, affinity + store / power of two"] is False
    assert judged["hit rate, affinity + store / 1 replica"] is None  # no single run: not judged


def test_a_failed_configuration_is_reported_as_failed():
    failed = {"config": "pow2", "label": "2 replicas, power of two", "router": "pow2",
              "summary": {"completed": 0, "failed": 128}, "first_error": "RuntimeError: the replicas did not start"}
    r = results(run("single", "1 replica", 0.4, 10.0), failed)
    text = render(r)
    assert "| 2 replicas, power of two | 0 / 128 | all failed: RuntimeError: the replicas did not start |" in text
    assert r["ratios"]["affinity/pow2:hit"] is None
