"""The plugin creator's fields are generated from KVPolicy and cannot drift from it."""


from criticalkv import KVPolicy
from criticalkv.spec.generate import FIELDS_HEADER as HEADER_PATH
from criticalkv.spec.generate import plugin_field_specs, render_policy_fields_header
from criticalkv.node import LAYER_ATTRIBUTES, knob_fields, node_attributes

TRT_TYPE_CODES = {"kCHAR": 6, "kINT32": 5, "kFLOAT32": 1}


def test_generated_header_is_up_to_date():
    assert HEADER_PATH.read_text() == render_policy_fields_header(), (
        "plugins/include/criticalkv/policy_fields.h is stale: run "
        "`python -m criticalkv.spec.generate`"
    )


def test_field_specs_are_the_knobs_and_the_layer_attributes():
    names = [spec.name for spec in plugin_field_specs()]
    assert names == list(KVPolicy.knob_names()) + list(LAYER_ATTRIBUTES)
    assert set(names) == set(node_attributes(KVPolicy(), 0, 1, 1)), "plugin fields == ONNX node attributes"
    types = {f.name: f.type for f in knob_fields()}
    for spec in plugin_field_specs():
        if spec.name in types:
            assert {"str": "kCHAR", "int": "kINT32", "float": "kFLOAT32"}[types[spec.name]] == spec.trt_type


def test_every_creator_advertises_exactly_the_generated_fields(harness):
    """CriticalKVSelect and CriticalKVScore: the node attributes; CriticalKVSelectModel: the model node's (the knobs,
    num_layers, capacities: criticalkv.export.model_select.model_node)."""
    from criticalkv.export.model_select import MODEL_ATTRIBUTES

    creators = harness.creators()
    assert [c["name"] for c in creators] == ["CriticalKVSelect"] * 2 + ["CriticalKVScore"] * 2 + ["CriticalKVSelectModel"] * 2
    want = [(s.name, TRT_TYPE_CODES[s.trt_type]) for s in plugin_field_specs()]
    for creator in creators[:4]:
        assert [(f["name"], f["type"]) for f in creator["fields"]] == want
    model = [(s.name, TRT_TYPE_CODES[s.trt_type]) for s in plugin_field_specs() if s.name in KVPolicy.knob_names()]
    model += [("num_layers", TRT_TYPE_CODES["kINT32"]), ("capacities", TRT_TYPE_CODES["kINT32"])]
    assert [name for name, _ in model] == list(KVPolicy.knob_names()) + list(MODEL_ATTRIBUTES)
    for creator in creators[4:]:
        assert [(f["name"], f["type"]) for f in creator["fields"]] == model


def test_missing_knobs_take_the_kvpolicy_defaults(harness):
    from ckv_native import encode_fields

    handle = harness.create(encode_fields({"capacity": 300}))
    assert handle >= 0, harness.logs()
    fields = {f["name"]: f["value"] for f in harness.describe(handle)["fields"]}
    default = KVPolicy()
    assert fields == {**default.attributes(), "layer_idx": 0, "num_layers": 1, "capacity": 300,
                      "layer_budgets": list(range(default.budget - default.window + 1))}


def test_methods_without_a_cpp_flow_are_refused(host_lib):
    from ckv_native import encode_fields, node_fields
    from criticalkv.methods import METHODS

    refused = [name for name, m in METHODS.items() if not m.base.native]
    # a model-level selection needs every layer's scores in one node; expected attention needs RoPE's tables
    assert refused == ["layer-defensivekv", "expected-attention", "layer-kvzip", "expected-criticalkv",
                       "layer-kvzip-criticalkv"]
    for name in ("expected-attention", "expected-criticalkv"):
        error = host_lib.parse(encode_fields(node_fields(KVPolicy(name))))
        assert error == (f"name: {name} reads RoPE's rotation averaged over the next future_positions positions, an "
                         "input the CriticalKVSelect plugin does not take; select it on the PyTorch path or ONNX Runtime")
    for name in ("layer-defensivekv", "layer-kvzip", "layer-kvzip-criticalkv"):
        error = host_lib.parse(encode_fields(node_fields(KVPolicy(name))))
        assert error == (f"name: {name} shares the budget across all layers, and the CriticalKVSelect plugin selects "
                         "one layer per node: its graph selects with a CriticalKVScore node per layer and one "
                         "CriticalKVSelectModel node (plugins/README.md)")
    # the kvzip pair ranks by the graph's scores, the plugin's seventh input (test_plugin_scores_input.py)
    for name in ("ada-criticalkv", "defensivekv", "kvzip", "kvzip-criticalkv"):
        assert host_lib.parse(encode_fields(node_fields(KVPolicy(name)))) == ""
