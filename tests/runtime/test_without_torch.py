"""The ONNX Runtime side runs where torch cannot be imported: the Triton model's process never needs it.

The engine is exported here (PyTorch), then loaded and run in a subprocess whose ``sys.modules["torch"]`` is None,
so any import of torch there raises. The subprocess first runs the Triton model's own ``criticalkv`` imports, read
from ``criticalkv/serving/templates/model.py``, then generates greedily, with the built budget and with a
per-request one: the same tokens as in this process.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from criticalkv import KVPolicy
from criticalkv.runtime import Engine
from export.tiny_engine import export_tiny_engine
from hf.conftest import tiny_model

TEMPLATE = Path(__file__).resolve().parents[2] / "criticalkv" / "serving" / "templates" / "model.py"

RUN = """
import json, sys
sys.modules["torch"] = None  # any import of torch raises from here on
{imports}
from criticalkv.runtime import Engine

folder, prompt = sys.argv[1], json.loads(sys.argv[2])
engine = Engine.load(folder)
tokens = [engine.generate([prompt], max_new_tokens=8, stop_token_ids=[], kv_budget=budget).tokens[0]
          for budget in (None, 24)]
print(json.dumps({{"tokens": tokens, "torch": sys.modules["torch"] is None}}))
"""


def template_imports() -> list[str]:
    """The Triton model's ``criticalkv`` import statements, as written in its template."""
    tree = ast.parse(TEMPLATE.read_text())
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("criticalkv")]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    return export_tiny_engine(tiny_model("llama", seed=4), KVPolicy("criticalkv", budget=40, window=8), folder)


def test_the_template_imports_something():
    assert any("criticalkv.runtime" in line for line in template_imports()), template_imports()


def test_an_engine_generates_in_a_process_without_torch(engine_dir):
    prompt = [(7 * i + 3) % 120 + 1 for i in range(100)]  # longer than the budget: the selection runs
    engine = Engine.load(engine_dir)
    try:
        expected = [engine.generate([prompt], max_new_tokens=8, stop_token_ids=[], kv_budget=budget).tokens[0]
                    for budget in (None, 24)]
    finally:
        engine.close()
    code = RUN.format(imports="\n".join(template_imports()))
    result = subprocess.run([sys.executable, "-c", code, str(engine_dir), json.dumps(prompt)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["torch"], "torch was imported after all"
    assert out["tokens"] == expected
