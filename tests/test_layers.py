"""The one staircase: every module of ``criticalkv`` imports only from its own unit or from units on lower floors.

``FLOORS`` is the allowed order, from the ground up (docs/architecture.md draws the same list and says why each
unit stands where it does). A unit is a package or a module; a module belongs to the longest unit that names it.
Every module of the package is parsed with ``ast``; an import counts wherever it stands (module top, inside a
function, under ``if TYPE_CHECKING``), and so do ``importlib.import_module("criticalkv...")`` calls and, in a module
that loads modules by a computed name (the CLI's subcommands, the runtime's backends), every string that names a
module of the package. Importing ``a.b.c`` also runs the package faces ``a.b/__init__`` on the way, so those count
too. There is no exception list: a new module that no floor names fails until it is placed.

The runtime stands above ``hf`` and ``selection`` (its torch backend runs the model's own layers and the selection op,
and every backend is registered in code, by name, in ``runtime/registry.py``), yet its ONNX Runtime side never reaches
torch: ``test_onnx_runtime_side_never_reaches_torch`` follows every import of ``runtime`` and ``serving`` (those inside
functions too) except the backends the registry loads by name, and fails on any path to a unit where PyTorch is
imported; ``test_onnx_runtime_side_imports_without_torch`` here and ``tests/runtime/test_without_torch.py`` (an engine
generating where torch cannot be imported) check the same at run time.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "criticalkv"

#: The allowed order, ground floor first. A module may import its own unit and any unit on a LOWER floor; never a
#: unit on its own floor or above (so two units on one floor do not know each other).
FLOORS: tuple[tuple[str, ...], ...] = (
    # the signal bookkeeping of the command line (Ctrl-C / SIGTERM noted early, raised where they are safe)
    ("criticalkv.interrupts",),
    # 0. leaves: the knob rules, the error types, prompts as token ids (chat template, context / question), file and
    #    padding helpers, external ONNX weights, the graphs' names (files, inputs, outputs)
    ("criticalkv.spec", "criticalkv.spec.rules", "criticalkv.errors", "criticalkv.chat", "criticalkv.files",
     "criticalkv.padding", "criticalkv.weights", "criticalkv.graphs"),
    # 1. the eviction methods: scores, budget sharing, integer rules, top-k, pruned stage 2, ONNX pieces
    ("criticalkv.methods",),
    # 2. KVPolicy (reads the methods registry)
    ("criticalkv.policy",),
    # 3. the CriticalKVSelect node contract (attributes, capacities, plugin fields, profile branch names); the request
    #    rules (Request, SamplingParams: one place, checked against the policy)
    ("criticalkv.node", "criticalkv.request"),
    # 4. next-token sampling and the decode loop (NumPy); the TensorRT plugin library and engine building (tensorrt
    #    itself is optional)
    ("criticalkv.sampling", "criticalkv.tensorrt"),
    # 5. PyTorch from here up: the reference selection (the oracle)
    ("criticalkv.selection",),
    # 6. the package's face: KVPolicy, select_layer, ... loaded on first use
    ("criticalkv",),
    # 7. transformers integration (the torch backend's decoder, compress, loading)
    ("criticalkv.hf",),
    # 8. the runtime: Engine over ONNX Runtime, TensorRT or torch, every backend registered by name in
    #    runtime/registry.py. Its ONNX Runtime side never reaches torch: test_onnx_runtime_side_never_reaches_torch
    ("criticalkv.runtime",),
    # 9. serving: scheduler, Triton model and repository, launcher (torch-free like the runtime's ONNX side)
    ("criticalkv.serving",),
    # 10. past one machine: engine replicas on Ray Serve behind the OpenAI API, context affinity, the shared store
    #     (torch-free too; only its modules import Ray)
    ("criticalkv.replicas",),
    # 11-12. the ONNX export, the build pipeline
    ("criticalkv.export",),
    ("criticalkv.build",),
    # 13-14. quality evaluation, then speed and serving benchmarks (which borrow eval's haystack text)
    ("criticalkv.eval",),
    ("criticalkv.bench",),
    # 15-16. the command line, and the generator of the derived files
    ("criticalkv.commands", "criticalkv.spec.generate"),
    ("criticalkv.cli",),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
UNITS = {unit: floor for floor, units in enumerate(FLOORS) for unit in units}
NAME = re.compile(r"criticalkv(\.\w+)*")


def unit_of(module: str) -> str | None:
    """The longest unit naming ``module`` (the root unit ``criticalkv`` names only the root package itself)."""
    best = None
    for unit in UNITS:
        if module == unit or (unit != "criticalkv" and module.startswith(unit + ".")):
            if best is None or len(unit) > len(best):
                best = unit
    return best


def resolve(name: str) -> str | None:
    """The package module that an imported dotted name loads: ``a.b.c`` if it is a module, else its package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def faces(module: str) -> list[str]:
    """The packages whose ``__init__`` runs when ``module`` is imported (the root's own is checked apart)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def imports_of(module: str) -> dict[str, int]:
    """Package modules that ``module`` imports, anywhere in its file -> the first line that does."""
    path = MODULES[module]
    return imports_in(path.read_text(), module, path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool = False, registry: bool = True) -> dict[str, int]:
    """``imports_of`` for the text ``source`` of ``module`` (``registry``: also the modules a registry spells)."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str | None, line: int) -> None:
        target = resolve(name) if name else None
        if target and target != module:
            found.setdefault(target, line)

    dynamic = False  # does the module load modules by a computed name?
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("criticalkv"):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.startswith("criticalkv"):
                for alias in node.names:
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base, node.lineno)
        elif isinstance(node, ast.Call) and _loader_name(node.func) in ("import_module", "__import__") and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                add(name.value if name.value.startswith("criticalkv") else None, node.lineno)
            else:
                dynamic = True
    if dynamic and registry:  # a registry ("criticalkv.x.y" or "criticalkv.x.y:Name" strings): every module it spells counts
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.split(":")[0]
                if NAME.fullmatch(text) and text in MODULES:
                    add(text, node.lineno)
    return found


def _loader_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_stands_on_a_floor():
    unplaced = sorted(m for m in MODULES if unit_of(m) is None)
    assert not unplaced, f"modules no floor names (place them in FLOORS and docs/architecture.md): {unplaced}"
    assert len(UNITS) == sum(len(units) for units in FLOORS), "a unit is named on two floors"
    assert not [u for u in UNITS if u not in MODULES], "a unit names no module of the package"


def test_no_import_runs_sideways_or_up():
    problems = []
    for module, targets in GRAPH.items():
        here = unit_of(module)
        for target, line in targets.items():
            for reached in [target, *faces(target)]:
                there = unit_of(reached)
                if there == here or there is None:
                    continue
                if UNITS[there] >= UNITS[here]:
                    way = "sideways" if UNITS[there] == UNITS[here] else "up"
                    problems.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} (floor {UNITS[here]}) "
                                    f"imports {reached} (floor {UNITS[there]}): {way}")
    assert not problems, "imports against the staircase:\n" + "\n".join(sorted(set(problems)))


def test_no_import_cycle():
    """Tarjan's strongly connected components over every import (those inside a unit included)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH)))
    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_root_package_loads_nothing_at_import():
    """``criticalkv/__init__`` runs before any submodule: it imports none, so importing ``criticalkv.spec.rules``
    loads the rules and nothing else (its names come on first use, through ``__getattr__``)."""
    tree = ast.parse(MODULES["criticalkv"].read_text())
    eager = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
             and any((getattr(n, "module", None) or a.name).startswith("criticalkv") for a in n.names)]
    assert not eager, f"criticalkv/__init__.py imports package modules at lines {eager}"
    code = ("import json, sys, criticalkv.spec.rules; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('criticalkv'))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert loaded == ["criticalkv", "criticalkv.spec", "criticalkv.spec.rules"]


def test_the_walker_sees_every_kind_of_import():
    """Imports inside functions and under TYPE_CHECKING, import_module strings, registries, relative imports."""
    source = ("import importlib\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from criticalkv.policy import KVPolicy\n"
              "def f():\n    from criticalkv.selection import layer, select_layer\n"
              "def g():\n    return importlib.import_module('criticalkv.export.graph')\n"
              "REGISTRY = {'x': 'criticalkv.hf.loading:load_model'}\n"
              "def h(name):\n    return importlib.import_module(REGISTRY[name].split(':')[0])\n"
              "from . import manifest\nfrom .backend import Backend\n")
    found = imports_in(source, "criticalkv.runtime.probe")
    assert set(found) == {"criticalkv.policy", "criticalkv.selection.layer", "criticalkv.selection",
                          "criticalkv.export.graph", "criticalkv.hf.loading", "criticalkv.runtime.manifest",
                          "criticalkv.runtime.backend"}
    # a module that names another only in a string (a command line, a policy called "criticalkv") imports nothing
    assert imports_in("import subprocess, sys\nNAME = 'criticalkv'\n"
                      "subprocess.run([sys.executable, '-m', 'criticalkv.cli', 'serve'])\n", "criticalkv.bench.x") == {}
    # and the package's own loads by name are seen: the CLI's subcommands, the runtime's backends, the face's names
    assert "criticalkv.commands.serve" in GRAPH["criticalkv.cli"]
    assert "criticalkv.runtime.onnxruntime_backend" in GRAPH["criticalkv.runtime.registry"]
    assert {"criticalkv.policy", "criticalkv.selection"} <= set(GRAPH["criticalkv"])


#: The units where PyTorch is imported (or may be, through them): the ONNX Runtime side must never reach one.
TORCH_UNITS = ("criticalkv.selection", "criticalkv", "criticalkv.hf", "criticalkv.export", "criticalkv.build",
               "criticalkv.eval", "criticalkv.bench", "criticalkv.commands", "criticalkv.spec.generate", "criticalkv.cli")
#: The units of the ONNX Runtime side (what a Triton model serving an ONNX Runtime engine imports).
ONNX_SIDE = ("criticalkv.runtime", "criticalkv.serving", "criticalkv.replicas")


def test_onnx_runtime_side_never_reaches_torch():
    """From every module of ``runtime`` and ``serving`` but the backends the registry loads by name (the torch and
    TensorRT backends import torch), no chain of imports (inside functions too) reaches a unit of TORCH_UNITS or a
    module that imports torch itself."""
    from criticalkv.runtime.registry import BACKENDS

    by_name = {target.split(":")[0] for target in BACKENDS.values()}
    assert "criticalkv.runtime.torch_backend" in by_name, "the torch backend is registered in code"
    static = {m: imports_in(MODULES[m].read_text(), m, MODULES[m].name == "__init__.py", registry=False)
              for m in MODULES}
    torch_modules = {m for m, path in MODULES.items()
                     if re.search(r"^\s*(import torch\b|from torch\b)", path.read_text(), re.M)}
    problems = []
    for start in sorted(m for m in MODULES if unit_of(m) in ONNX_SIDE and m not in by_name):
        seen, path_to = {start}, {start: [start]}
        todo = [start]
        while todo:
            here = todo.pop()
            for target in static[here]:
                for reached in [target, *faces(target)]:
                    if reached in seen:
                        continue
                    seen.add(reached)
                    path_to[reached] = path_to[here] + [reached]
                    if unit_of(reached) in TORCH_UNITS or reached in torch_modules or reached in by_name:
                        problems.append(" -> ".join(path_to[reached]))
                    else:
                        todo.append(reached)
    assert not problems, "the ONNX Runtime side reaches torch:\n" + "\n".join(sorted(problems))


@pytest.mark.parametrize("module", ["criticalkv.runtime", "criticalkv.serving", "criticalkv.replicas", "criticalkv"])
def test_onnx_runtime_side_imports_without_torch(module):
    """``python -c "import sys; sys.modules['torch'] = None; import criticalkv.runtime"`` works."""
    code = f"import sys; sys.modules['torch'] = None; import {module}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


#: The drivers: they run every method through its hooks (``BaseMethod``, ``criticalkv.methods.phases``) and name none.
DRIVERS = ("criticalkv.export", "criticalkv.runtime", "criticalkv.serving", "criticalkv.replicas")


def _method_modules() -> set[str]:
    """The modules that define a registered policy's base method or refinement (what the methods share: base, knobs,
    phases, budget, top-k, pruned stage 2, is not one)."""
    from criticalkv.methods import METHODS

    return {type(part).__module__ for method in METHODS.values() for part in (method.base, method.refine)
            if part is not None}


def test_the_drivers_import_no_method_module():
    """The exporter, the backends, the server and the replicas reach a method through the registry and its hooks
    (``policy.method``), never by importing a method's module: a method's module changes alone."""
    methods = _method_modules()
    assert {"criticalkv.methods.kvzip", "criticalkv.methods.expected_attention",
            "criticalkv.methods.two_stage"} <= methods, methods  # the scan finds them
    problems = [f"{MODULES[m].relative_to(ROOT)}:{line}: imports {target}"
                for m, targets in GRAPH.items() if unit_of(m) in DRIVERS
                for target, line in targets.items() if target in methods]
    assert not problems, "a driver imports a method's module:\n" + "\n".join(sorted(problems))


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of ``path``'s lines outside docstrings and comments."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return [(n, line.split("#", 1)[0]) for n, line in enumerate(source.splitlines(), 1) if n not in docstrings]


def test_the_exporter_names_no_kvzip():
    """KVzip's export (its score streams, its surrogate, the TensorRT flavour's refusal) lives in its method's phases
    (``criticalkv.methods.kvzip``, ``criticalkv.methods.phases``): no line of code in export/ names it."""
    problems = [f"{path.relative_to(ROOT)}:{n}: {text.strip()}"
                for path in sorted((PACKAGE / "export").glob("*.py")) for n, text in _code_lines(path)
                if re.search(r"kvzip|surrogate", text, re.I)]
    assert not problems, "\n".join(problems)


#: Top-level folders of the checkout that are not installed (pyproject.toml finds ``criticalkv*`` only).
OUTSIDE = ("benchmarks", "research")


def test_the_package_imports_nothing_from_the_folders_beside_it():
    """``benchmarks/`` (the laboratory's benchmarks) and ``research/`` (one-off studies) import the package; nothing in
    the package imports them (an installed criticalkv has neither), not even by name through ``import_module``."""
    problems = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (isinstance(node, ast.Call) and _loader_name(node.func) in ("import_module", "__import__") and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            else:
                continue
            problems += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                         if name.split(".")[0] in OUTSIDE]
    assert not problems, "the package imports a folder that is not installed:\n" + "\n".join(problems)
    assert all((ROOT / folder).is_dir() for folder in OUTSIDE)
