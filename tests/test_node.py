import numpy as np
import onnx
import pytest
from onnx import helper

from criticalkv import KVPolicy
from criticalkv.node import DOMAIN, INPUTS, OP_TYPE, OUTPUTS, node_attributes, policy_from_attributes


@pytest.mark.parametrize("alpha, floor, beta", [(0.3, 0.2, 20.0), (0.1, 0.35, 7.5), (0.25, 0.0, 1.0), (0.7, 0.15, 3.3)])
def test_attributes_survive_an_onnx_node_round_trip(alpha, floor, beta):
    policy = KVPolicy("ada-criticalkv", budget=300, alpha=alpha, ada_floor=floor, pyramid_beta=beta, epsilon=1e-4)
    node = helper.make_node(OP_TYPE, list(INPUTS), list(OUTPUTS), domain=DOMAIN)
    # the knob "name" collides with make_node's own keyword: attributes go in one by one
    node.attribute.extend(helper.make_attribute(k, v) for k, v in node_attributes(policy, 3, 30, 500).items())
    read = {a.name: helper.get_attribute_value(a) for a in onnx.load_from_string(
        helper.make_model(helper.make_graph([node], "g", [], [])).SerializeToString()).graph.node[0].attribute}
    assert read["alpha"] != alpha or np.float32(alpha) == alpha  # ONNX really stores float32
    got, layer, layers, cap = policy_from_attributes(read)
    assert got == policy and (layer, layers, cap) == (3, 30, 500)
