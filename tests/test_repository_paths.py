"""Every path of this repository that a comment, a docstring or a doc names exists (renamed and removed files leave
stale names behind; this test counts them and prints each with its file and line).

What is read: the comments and docstrings of the Python, C++/CUDA, CMake and shell files, the whole text of the
Markdown files (README.md, docs/, plugins/, results/). A path is a word starting with one of the repository's
top-level folders (``criticalkv/``, ``tests/``, ``docs/``, ...) or a relative Markdown link (``[text](serving.md)``).
It resolves from the repository root, from the naming file's folder, or (C++ includes) from plugins/include; ``::test``
and ``:LINE`` suffixes are dropped; a glob must match something, ``{a,b}`` names both; a stem names the files it
begins (``results/<stem>`` for its .json and .md); what follows ``--out`` / ``--output`` or a ``default`` is what a
command writes, and so are the folders of ``OUTPUTS``: they need not exist. In results/, a line that is a recorded
command is left as it was run. Another project's file is named by that project and its own path (onnx-tensorrt's
operators.md), or by its URL.
"""

import ast
import io
import re
import tokenize
from itertools import product
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("criticalkv", "benchmarks", "research", "tests", "scripts", "plugins", "docs", "examples", "results", ".ci")
SKIP_DIRS = {".git", ".venv", "build", "__pycache__", "engines", ".triton", ".peers", ".whl", "out", "dist"}
CODE = {".py", ".cpp", ".h", ".cu", ".cuh", ".sh", ".cmake"}
PATH = re.compile(r"(?<![\w./~$@-])((?:%s)/[\w.*/{},<>-]*[\w*}>/])" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTPUT_FLAG = re.compile(r"((--out|--output|--out-dir|--artifact-dir)[ =]|default:?\s*`?)$")
#: Folders that commands write and the repository does not hold yet, and who writes them.
OUTPUTS = {"results/gpu/": "bash scripts/gpu_check.sh, criticalkv bench gpu and bench gpu-serve, on a GPU machine"}
#: A recorded command in results/ (``# python -m ...``, `` `python results/...` ``): left as it was run.
RECORDED = re.compile(r"^\s*[#`$>]*\s*(\S*/)?(python3?|criticalkv|bash)\s")


def scanned_files() -> list[Path]:
    files = [p for p in (ROOT / "README.md", ROOT / ".ci" / "run") if p.is_file()]
    for top in TOP:
        folder = ROOT / top
        if not folder.is_dir():
            continue
        for path in folder.rglob("*"):
            if any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts) or not path.is_file():
                continue
            if top == "results" and path.suffix != ".md":
                continue  # results' data and recorded commands name what they were run with
            if path.suffix in CODE | {".md"} or path.name == "CMakeLists.txt":
                files.append(path)
    return sorted(set(files))


def python_text(source: str) -> list[tuple[int, str]]:
    """(line, text) of the comments and docstrings of a Python file."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return out
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                for k, line in enumerate(first.value.value.splitlines()):
                    out.append((first.lineno + k, line))
    return out


def c_text(source: str) -> list[tuple[int, str]]:
    """(line, text) of the // and /* */ comments of a C++ / CUDA file."""
    out = []
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S):
        line = source.count("\n", 0, m.start()) + 1
        for k, text in enumerate(m.group(0).splitlines()):
            out.append((line + k, text))
    return out


def hash_comments(source: str) -> list[tuple[int, str]]:
    return [(i, line[line.index("#"):]) for i, line in enumerate(source.splitlines(), 1) if "#" in line]


def named_text(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(errors="replace")
    if path.suffix == ".py":
        return python_text(source)
    if path.suffix in (".cpp", ".h", ".cu", ".cuh"):
        return c_text(source)
    if path.suffix in (".sh", ".cmake") or path.name in ("CMakeLists.txt", "run"):
        return hash_comments(source)
    return list(enumerate(source.splitlines(), 1))


def expand(path: str) -> list[str]:
    parts = re.split(r"(\{[^{}]*\})", path)
    choices = [p[1:-1].split(",") if p.startswith("{") and p.endswith("}") else [p] for p in parts]
    return ["".join(c) for c in product(*choices)]


def resolves(name: str, where: Path) -> bool:
    for candidate in expand(name):
        candidate = candidate.rstrip(".,;:")
        bases = (ROOT, where.parent, ROOT / "plugins" / "include")
        if "*" in candidate:
            if not any(list(base.glob(candidate)) for base in bases):
                return False
            continue
        if any((base / candidate).exists() for base in bases):
            continue
        stem = ROOT / candidate
        if stem.parent.is_dir() and any(p.name.startswith(stem.name + sep) for p in stem.parent.iterdir()
                                        for sep in (".", "_", "-")):
            continue
        return False
    return True


def stale_names() -> list[str]:
    stale = []
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, text in named_text(path):
            for m in PATH.finditer(text):
                name = re.sub(r"::.*$", "", m.group(1))
                name = re.sub(r":\d[\d-]*.*$", "", name)
                if "<" in name or "..." in name or OUTPUT_FLAG.search(text[:m.start()]):
                    continue
                if any(name.startswith(out) for out in OUTPUTS) or (rel.startswith("results/")
                                                                     and RECORDED.match(text)):
                    continue
                if not resolves(name, path):
                    stale.append(f"{rel}:{line}: {name}")
            if path.suffix == ".md":
                for m in LINK.finditer(text):
                    target = m.group(1).split("#")[0]
                    if not target or re.match(r"[a-z]+:", target) or target.startswith("/"):
                        continue
                    if not (path.parent / target).exists():
                        stale.append(f"{rel}:{line}: link {target}")
    return stale


def test_every_repository_path_named_in_comments_and_docs_exists():
    stale = stale_names()
    assert stale == [], (f"{len(stale)} names of files that do not exist (rename them to the file meant):\n"
                         + "\n".join(stale))


def test_the_scan_finds_a_stale_name(tmp_path, monkeypatch):
    """The scan itself: a doc naming a file that does not exist is reported with its line; a stem, a glob and an
    output path are not."""
    import test_repository_paths as scan

    (tmp_path / "docs").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text("{}")
    (tmp_path / "docs" / "a.md").write_text("See docs/a.md, results/run (stem), docs/*.md, [b](b.md),\n"
                                            "`bench x --out results/new` and docs/gone.md.\n")
    monkeypatch.setattr(scan, "ROOT", tmp_path)
    assert scan.stale_names() == ["docs/a.md:1: link b.md", "docs/a.md:2: docs/gone.md"]
