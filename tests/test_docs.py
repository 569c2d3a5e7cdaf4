"""The documentation as tests: every shell block of README.md and docs/*.md runs and prints what the doc promises,
or says why it cannot run here (tests/docs_blocks.py: the markers, the substitutions, how servers and engines are
shared between blocks).

A failure names the file, the line of the block's fence and what to do; to add a documented command, write it in the
doc with its expected output as `<!-- expect: TEXT -->` on the line right above the fence (or
`<!-- not-run: REASON -->`), nothing else.
"""

import textwrap
from pathlib import Path

import pytest

from docs_blocks import REASONS, SUBSTITUTIONS, DocsFailure, DocsRunner, collect, parse

BLOCKS, PROBLEMS = collect()
RUN = [b for b in BLOCKS if b.not_run is None]


def test_every_shell_block_of_the_docs_is_run_or_says_why_not():
    """Unmarked shell blocks the suite does not run: 0. Every marker names a reason of the short list, every
    directive is one the suite reads, and a block of `$ ` commands is labelled console (so that it runs)."""
    assert PROBLEMS == [], "\n\n".join(PROBLEMS)
    assert len(BLOCKS) >= 20  # README.md and docs/ show that many; a parser that found none must not pass
    not_run = [b for b in BLOCKS if b.not_run is not None]
    assert all(b.not_run in REASONS for b in not_run)
    assert {b.id for b in RUN} | {b.id for b in not_run} == {b.id for b in BLOCKS}
    assert {b.id for b in RUN} == {b.id for b in BLOCKS if b.not_run is None}  # collected below, each a test


@pytest.fixture(scope="module", autouse=True)
def servers_stop_at_the_end(docs):
    yield
    assert docs.close() == []


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_the_documented_commands_run_and_print_what_the_docs_promise(docs, block):
    docs.run(block)


# ---------------------------------------------------------------------- the harness itself, on a made-up doc
def made_up_doc(tmp_path: Path, text: str) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    path = tmp_path / "docs" / "made_up.md"
    path.write_text(textwrap.dedent(text))
    return path


def test_the_harness_names_the_block_and_what_to_do(tmp_path):
    doc = made_up_doc(tmp_path, """\
        # A page

        <!-- expect: hello -->
        ```bash
        echo hello from "$(basename "$PWD")"
        ```

        <!-- expect: goodbye -->
        ```sh
        echo hello
        ```

        ```console
        $ false
        ```

        <!-- not-run: slow -->
        ```bash
        sleep 1000
        ```

        <!-- not-run: long -->

        ```bash
        echo a marker one line too far
        ```

        ```
        $ criticalkv serve --engine-dir engines/x
        ready: ...
        ```

        ```bash
        criticalkv generate --engine-dir engines/not-built-anywhere --prompt hi
        ```
        """)
    blocks, problems = parse(doc, tmp_path)
    assert [b.line for b in blocks] == [4, 9, 13, 18, 24, 33]
    assert [b.lang for b in blocks] == ["bash", "sh", "console", "bash", "bash", "bash"]
    text = "\n".join(problems)
    assert "docs/made_up.md:18 (shell block 4 of docs/made_up.md, ```bash): `<!-- not-run: slow -->` is not one" in text
    assert "docs/made_up.md:22: this not-run marker is not on the line right before the fence of line 24" in text
    assert "docs/made_up.md:28: a block of shell commands (`$ ` prompts) without an info string: label its fence" \
           " ```console" in text
    assert len(problems) == 3, problems

    runner = DocsRunner(tmp_path / "session", blocks=blocks)
    (tmp_path / "session").mkdir()
    assert "hello from" in runner.run(blocks[0]).stdout
    with pytest.raises(DocsFailure) as failure:
        runner.run(blocks[1])
    assert "docs/made_up.md:9 (shell block 2 of docs/made_up.md, ```sh) ran but did not print what its " \
           "`<!-- expect: ... -->` promises: ['goodbye']" in str(failure.value)
    with pytest.raises(DocsFailure) as failure:
        runner.run(blocks[2])
    assert "docs/made_up.md:13 (shell block 3 of docs/made_up.md, ```console) failed with status 1" \
           in str(failure.value)
    assert "`<!-- not-run: REASON -->` on the line right before the opening fence" in str(failure.value)
    with pytest.raises(DocsFailure) as failure:
        runner.run(blocks[5])
    assert "docs/made_up.md:33 (shell block 6 of docs/made_up.md, ```bash) uses engines/not-built-anywhere, which " \
           "no runnable block of README.md or docs/ builds" in str(failure.value)
    assert runner.close() == []


def test_the_substitutions_say_why():
    assert all(s.why for s in SUBSTITUTIONS)
    blocks = {b.id: b for b in BLOCKS}
    runner = DocsRunner(Path("/session"), blocks=list(blocks.values()))
    readme = runner.block("README.md", "scripts/build_engine.py")
    script = runner.substitute(readme, readme.text)
    assert "install.sh" not in script and f"--output /session/engines/smollm2-criticalkv " in script
    assert f"{runner.bin}/criticalkv generate --engine-dir /session/engines/smollm2-criticalkv" in script
    nested = DocsRunner(Path("/tmp/session"), blocks=list(blocks.values()))  # {tmp} under /tmp/: one pass, not two
    assert nested.substitute(readme, "--output engines/x --out /tmp/y") == \
        "--output /tmp/session/engines/x --out /tmp/session/tmp/y"


def test_code_and_docs_name_a_target_by_its_value_not_by_a_ticket():
    """The package, benchmarks/, research/, the plugins, the scripts and the docs speak to their readers: no "issue 26",
    "the issue's targets" (name the target itself: "goal: <= 3 % of a 32k prefill") and no word of how the work was
    organised ("lent")."""
    import re

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"issue [0-9]+|the issue|issue's|\blent\b", re.I)
    tops = ("criticalkv", "benchmarks", "research", "plugins", "scripts", "docs")
    files = [root / "README.md"] + [p for top in tops for p in sorted((root / top).rglob("*")) if p.is_file()]
    found = []
    for path in files:
        if "__pycache__" in path.parts or path.suffix in (".npz", ".so", ".pyc"):
            continue
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(root)}:{i}: {line.strip()}" for i, line in enumerate(lines, 1)
                  if pattern.search(line)]
    assert found == [], "\n".join(found)
