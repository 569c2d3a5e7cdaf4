"""Every file generated from the policy spec is up to date, and the spec's rules hold in Python and C++."""

import shutil
import subprocess
import sys

import pytest

from criticalkv import KVPolicy
from criticalkv.methods import METHODS
from criticalkv.node import LAYER_ATTRIBUTES, knob_fields, node_attributes
from criticalkv.spec.generate import CONFIG_HEADER, ROOT, generated_files, plugin_field_specs, stale_files


def test_generated_files_are_fresh():
    stale = [str(p.relative_to(ROOT)) for p in stale_files()]
    assert not stale, f"stale generated files {stale}: run `python -m criticalkv.spec.generate`"


def test_check_command_exits_zero_when_fresh():
    run = subprocess.run([sys.executable, "-m", "criticalkv.spec.generate", "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_plugin_fields_are_the_node_attributes():
    names = [s.name for s in plugin_field_specs()]
    assert names == list(KVPolicy.knob_names()) + list(LAYER_ATTRIBUTES)
    assert names == list(node_attributes(KVPolicy(), 0, 1, 1))


def test_every_knob_is_read_by_some_method_or_all():
    read = {k for m in METHODS.values() for k in m.knobs}
    for f in knob_fields():
        assert f.name in read or f.name in ("name", "budget", "window"), f"{f.name} is read by no method"


def test_policy_doc_table_lists_every_policy():
    readme = generated_files()[ROOT / "docs" / "policies.md"]
    for name in METHODS:
        assert f"| `{name}` |" in readme


CASES = [
    dict(),
    dict(alpha=0.1234567),
    dict(alpha=1.5),
    dict(alpha=-0.1),
    dict(budget=16),
    dict(window=0),
    dict(pool_kernel=4),
    dict(epsilon=-1.0),
    dict(value_norm="l3"),
    dict(ada_floor=2.0),
    dict(pyramid_beta=0.5),
    dict(pyramid_beta=2.0000001),
    dict(sink_tokens=-1),
    dict(name="streamingllm", sink_tokens=300),
    dict(name="snapkv", sink_tokens=300),
    dict(name="h2o"),
    dict(name="full", budget=1),
    # several bad knobs, said in KVPolicy's order: the types of the method's knobs, the rules of budget, window and
    # the method's knobs, then another method's knobs
    dict(sink_tokens=-1, alpha=1.5),
    dict(name="streamingllm", sink_tokens=-1, alpha=1.5),
    dict(budget=16, gqa_reduce="max"),
    dict(name="kvzip-criticalkv", kvzip_reread="x", value_norm="l3"),
]


def _python_message(kwargs):
    try:
        KVPolicy(**kwargs)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cpp_validation_gives_the_python_messages(tmp_path):
    """The generated C++ validatePolicy accepts and rejects the same configs with the same words."""
    lines = ['#include "criticalkv/policy_config.h"', "#include <cstdio>", "int main() {"]
    defaults = KVPolicy().to_dict()
    for kwargs in CASES:
        values = {**defaults, **kwargs}
        lines.append("  { criticalkv::PolicyConfig p; p.capacity = 1;")
        for k, v in values.items():
            lines.append(f"    p.{k} = {v!r};".replace("'", '"') if isinstance(v, str) else f"    p.{k} = {v!r};")
        lines.append("    if (p.name != \"full\") for (int b = p.window; b <= p.budget; ++b) p.layer_budgets.push_back(0);")
        lines.append('    std::printf("%s\\n", criticalkv::validatePolicy(p).c_str()); }')
    lines.append("}")
    source = tmp_path / "validate.cpp"
    source.write_text("\n".join(lines))
    binary = tmp_path / "validate"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", f"-I{CONFIG_HEADER.parents[1]}", str(source), "-o", str(binary)],
                   check=True, capture_output=True)
    got = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert got == [_python_message(k) for k in CASES]
