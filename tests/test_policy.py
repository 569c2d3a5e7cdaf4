import argparse
import dataclasses
import json
import warnings

import pytest

from criticalkv import POLICIES, KVPolicy
from criticalkv.policy import policy_table_markdown


def test_defaults_follow_the_paper():
    p = KVPolicy()
    assert (p.name, p.window, p.pool_kernel, p.alpha, p.epsilon) == ("criticalkv", 32, 7, 0.25, 1e-4)
    assert (p.value_norm, p.gqa_reduce, p.stage2_scores) == ("l1", "mean", "pooled")
    assert (p.ada_floor, p.pyramid_beta, p.sink_tokens) == (0.2, 20.0, 4)
    assert p.base == "snapkv" and p.two_stage and p.selectable_budget == 256 - 32


def test_registry_maps_names_to_base_and_stage2():
    assert set(POLICIES) == {
        "full", "streamingllm", "snapkv", "pyramidkv", "adakv", "laprox",
        "criticalkv", "pyramid-criticalkv", "ada-criticalkv", "defensivekv", "layer-defensivekv",
        "expected-attention", "expected-criticalkv", "kvzip", "kvzip-criticalkv", "layer-kvzip",
        "layer-kvzip-criticalkv", "keydiff",
    }
    assert KVPolicy("layer-kvzip-criticalkv").base == "layer-kvzip" and KVPolicy("layer-kvzip-criticalkv").two_stage
    assert KVPolicy("kvzip-criticalkv").base == "kvzip" and KVPolicy("kvzip-criticalkv").two_stage
    assert KVPolicy("expected-criticalkv").base == "expected-attention" and KVPolicy("expected-criticalkv").two_stage
    assert KVPolicy("layer-defensivekv").base == "layer-defensivekv" and not KVPolicy("defensivekv").two_stage
    assert KVPolicy("pyramid-criticalkv").base == "pyramidkv" and KVPolicy("pyramid-criticalkv").two_stage
    assert KVPolicy("ada-criticalkv").base == "adakv" and not KVPolicy("adakv").two_stage


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(name="h2o"), "name"),
        (dict(budget=0), "budget"),
        (dict(budget=-5), "budget"),
        (dict(budget=16, window=32), "budget"),
        (dict(window=0), "window"),
        (dict(name="defensivekv", stage1_mass=1.5), "stage1_mass"),
        (dict(stage1_mass=-0.1), "stage1_mass"),
        (dict(window=-1), "window"),
        (dict(alpha=-0.1), "alpha"),
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=float("nan")), "alpha"),
        (dict(pool_kernel=4), "pool_kernel"),
        (dict(pool_kernel=0), "pool_kernel"),
        (dict(epsilon=-1.0), "epsilon"),
        (dict(value_norm="l3"), "value_norm"),
        (dict(gqa_reduce="max"), "gqa_reduce"),
        (dict(stage2_scores="cooked"), "stage2_scores"),
        (dict(ada_floor=2.0), "ada_floor"),
        (dict(pyramid_beta=0.5), "pyramid_beta"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(budget=12.5), "budget"),
        (dict(window=True), "window"),
    ],
)
def test_bad_knobs_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        KVPolicy(**kwargs)


def test_full_ignores_the_budget_window_relation():
    assert KVPolicy("full", budget=1, window=32).name == "full"


def test_json_round_trip_and_schema():
    p = KVPolicy("ada-criticalkv", budget=512, alpha=0.5, pyramid_beta=10.0)
    text = p.to_json()
    assert json.loads(text)["schema_version"] == 1
    assert KVPolicy.from_json(text) == p
    assert KVPolicy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ValueError, match="unknown KVPolicy field"):
        KVPolicy.from_dict({"name": "snapkv", "budgte": 3})
    with pytest.raises(ValueError, match="schema_version"):
        KVPolicy.from_json(json.dumps({"schema_version": 99, "name": "snapkv"}))


def test_cli_flags_json_and_fields_are_one_set():
    """Every knob is reachable on the command line (name, budget and window by their flags, the others as keys of
    --kv-policy's spec), and the JSON keys are the policy's fields and its method's knobs."""
    parser = argparse.ArgumentParser()
    KVPolicy.add_arguments(parser)
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    fields = set(KVPolicy.knob_names())  # every knob: the policy's name, budget and window, and every method's knobs
    assert {f.name for f in dataclasses.fields(KVPolicy)} == {"name", "budget", "window", "knobs"}
    for name in POLICIES:
        assert set(KVPolicy(name).to_dict()) == {"name", "budget", "window", *KVPolicy(name).method.knobs} <= fields
    assert fields == set(KVPolicy().attributes())
    assert dests == {"kv_policy", "budget", "window"}
    flags = {s for a in parser._actions for s in a.option_strings}
    assert flags == {"--kv-policy", "--budget", "--window", "-h", "--help"}
    spec_keys = {KVPolicy.flag_of(k) for k in fields if k not in KVPolicy.FLAGGED}
    assert spec_keys == {f":{k}=" for k in fields - set(KVPolicy.FLAGGED)}
    for knob in fields - {"name", "budget"}:  # every other knob parses from a spec
        value = getattr(KVPolicy(), knob)
        assert KVPolicy.from_args(parser.parse_args(["--kv-policy", f"criticalkv:{knob}={value}"])) == KVPolicy()


def test_cli_parses_into_a_policy_and_rejects_bad_choices(capsys):
    parser = argparse.ArgumentParser()
    KVPolicy.add_arguments(parser)
    args = parser.parse_args(["--kv-policy", "pyramidkv:alpha=0.5:value_norm=l2", "--budget", "128"])
    assert KVPolicy.from_args(args) == KVPolicy("pyramidkv", budget=128, alpha=0.5, value_norm="l2")
    with pytest.raises(ValueError, match="unknown KV policy 'nope'"):
        KVPolicy.from_args(parser.parse_args(["--kv-policy", "nope"]))
    with pytest.raises(ValueError, match="value_norm: 'l3' is not one of l1, l2"):
        KVPolicy.from_args(parser.parse_args(["--kv-policy", "criticalkv:value_norm=l3"]))
    optional = argparse.ArgumentParser()
    KVPolicy.add_arguments(optional, optional=True)
    left_out = optional.parse_args([])
    assert (left_out.kv_policy, left_out.budget, left_out.window) == (None, None, None)
    assert KVPolicy.from_args(left_out, KVPolicy("snapkv", budget=64)) == KVPolicy("snapkv", budget=64)


def test_policy_table_lists_every_policy_and_knob():
    table = policy_table_markdown()
    for name in POLICIES:
        assert f"`{name}`" in table
    for name in KVPolicy.knob_names():
        assert f"`{name}`" in table


def test_policy_specs_round_trip_and_name_the_flag():
    from criticalkv.build import context_policy_for
    from criticalkv.policy import parse_policy_spec, policy_spec

    base = KVPolicy(budget=128, window=16)
    for spec in ("kvzip", "kvzip:kvzip_chunk=512:kvzip_reread=chunk", "kvzip-criticalkv:alpha=0.5", "snapkv"):
        policy = parse_policy_spec(spec, base)
        assert policy.budget == 128 and policy.window == 16
        assert parse_policy_spec(policy_spec(policy), base) == policy
    assert policy_spec(parse_policy_spec("kvzip:kvzip_reread=chunk:kvzip_chunk=512", base)) == \
        "kvzip:kvzip_chunk=512:kvzip_reread=chunk"  # the method's knob order
    engine = KVPolicy("criticalkv", budget=256, window=32)
    built = context_policy_for(engine, "kvzip-criticalkv:kvzip_reread=chunk:kvzip_chunk=512")
    assert (built.name, built.budget, built.window, built.kvzip_reread, built.kvzip_chunk) == \
        ("kvzip-criticalkv", 256, 32, "chunk", 512)
    for bad, words in (("kvzip:kvzip_reread=whole", "is not one of"), ("kvzip:kvzip_chunk=many", "not a valid int"),
                       ("kvzip:budget=64", "--budget"), ("nope", "unknown KV policy")):
        with pytest.raises(ValueError, match="--context-policy") as err:
            context_policy_for(engine, bad)
        assert words in str(err.value), (bad, str(err.value))
    assert context_policy_for(engine, "engine") is None and context_policy_for(KVPolicy("full"), "kvzip") is None


def test_a_spec_knob_the_method_does_not_read_is_said():
    from criticalkv.policy import parse_policy_spec, spec_knobs

    assert spec_knobs("snapkv") == ["pool_kernel", "window"] and spec_knobs("full") == []
    with pytest.warns(UserWarning, match=r"snapkv does not read kvzip_chunk .*its knobs: pool_kernel, window"):
        assert parse_policy_spec("snapkv:kvzip_chunk=100", KVPolicy()) == KVPolicy("snapkv")  # changes nothing
    with pytest.raises(ValueError, match=r"unknown knob 'kvzip_chunks' .*snapkv's knobs: pool_kernel, window"):
        parse_policy_spec("snapkv:kvzip_chunks=100", KVPolicy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_policy_spec("layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6:window=16", KVPolicy())


def test_the_knobs_are_the_methods_dataclass_and_old_manifests_load():
    import pickle

    from criticalkv.methods.kvzip import KVzipKnobs
    from criticalkv.methods.two_stage import TwoStageKnobs

    p = KVPolicy("kvzip-criticalkv", budget=128, alpha=0.5, kvzip_chunk=512)
    # a two-stage policy's knobs: its base's, then CriticalKV's, in one frozen dataclass
    names = [f.name for f in dataclasses.fields(p.knobs)]
    assert names == [f.name for f in dataclasses.fields(KVzipKnobs)] + [f.name for f in dataclasses.fields(TwoStageKnobs)]
    assert (p.knobs.alpha, p.knobs.kvzip_chunk, p.alpha, p.kvzip_chunk) == (0.5, 512, 0.5, 512)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.knobs.alpha = 0.1
    assert pickle.loads(pickle.dumps(p)) == p and hash(pickle.loads(pickle.dumps(p))) == hash(p)
    # the manifest records the method's knobs only
    assert set(p.to_dict()) == {"name", "budget", "window", *names}
    # a manifest written before (every knob of every method) still loads, the knobs the method does not read dropped
    old = {**KVPolicy().attributes(), "name": "kvzip-criticalkv", "budget": 128, "alpha": 0.5, "kvzip_chunk": 512}
    assert set(old) == set(KVPolicy.knob_names()) and KVPolicy.from_dict(old) == p
    # another method's knob: checked against its rules, then dropped; read through the policy, it is its default
    assert KVPolicy("snapkv", alpha=0.5) == KVPolicy("snapkv") and KVPolicy("snapkv", alpha=0.5).alpha == 0.25
    with pytest.raises(ValueError, match="^alpha:"):
        KVPolicy("snapkv", alpha=1.5)
    with pytest.raises(TypeError, match="unknown knob.*alpah.*snapkv's knobs: pool_kernel"):
        KVPolicy("snapkv", alpah=0.5)  # no method declares it
    # a new name keeps the knobs both methods read
    assert p.replace(name="kvzip").knobs == KVzipKnobs(kvzip_chunk=512)
    assert KVPolicy("criticalkv", alpha=0.5, pool_kernel=5).replace(name="ada-criticalkv").knobs.pool_kernel == 5
