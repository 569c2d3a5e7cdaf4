"""The shared table of policies every test runs (one line per policy or knob variant)."""

from criticalkv import KVPolicy

#: (id, KVPolicy keyword arguments other than the budget and window)
POLICY_CASES = [
    ("full", dict(name="full")),
    ("streamingllm", dict(name="streamingllm")),
    ("snapkv", dict(name="snapkv")),
    ("pyramidkv", dict(name="pyramidkv")),
    ("adakv", dict(name="adakv")),
    ("laprox", dict(name="laprox")),
    ("criticalkv", dict(name="criticalkv")),
    ("criticalkv-raw", dict(name="criticalkv", stage2_scores="raw")),
    ("criticalkv-l2", dict(name="criticalkv", value_norm="l2")),
    ("criticalkv-kvpress", dict(name="criticalkv", gqa_reduce="kvpress", alpha=0.5)),
    ("pyramid-criticalkv", dict(name="pyramid-criticalkv")),
    ("ada-criticalkv", dict(name="ada-criticalkv")),
    ("defensivekv", dict(name="defensivekv")),
    ("defensivekv-mass0.2", dict(name="defensivekv", stage1_mass=0.2)),
    ("expected-attention", dict(name="expected-attention")),
    ("expected-criticalkv", dict(name="expected-criticalkv", future_positions=64)),
    ("kvzip", dict(name="kvzip")),
    ("kvzip-criticalkv", dict(name="kvzip-criticalkv", kvzip_chunk=64)),
    ("keydiff", dict(name="keydiff")),
]

#: Two-stage policies and the base method alpha = 1 must reduce them to.
TWO_STAGE_BASES = [("criticalkv", "snapkv"), ("pyramid-criticalkv", "pyramidkv"), ("ada-criticalkv", "adakv"),
                   ("expected-criticalkv", "expected-attention"), ("kvzip-criticalkv", "kvzip")]


def make_policy(kwargs: dict, budget: int, window: int, **extra) -> KVPolicy:
    return KVPolicy(**{**kwargs, "budget": budget, "window": window, **extra})
