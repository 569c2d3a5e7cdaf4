"""The shell blocks of README.md and docs/*.md as tests (tests/test_docs.py runs them).

Every fenced block whose info string is ``bash``, ``sh``, ``shell`` or ``console`` is run as written, from the
repository root, after the substitutions of ``SUBSTITUTIONS`` (one table: what a command names on a user's machine
that the test suite replaces, and why), unless the line right before its opening fence is
``<!-- not-run: REASON -->`` with REASON one of ``REASONS``. What a block must print is written in the doc itself,
as HTML comments on the lines right before the fence (a reader of the rendered page does not see them):

    <!-- expect: 7481 -->
    <!-- expect: "context_cache_hit": true -->
    ```bash
    curl -s localhost:9000/v1/chat/completions ...
    ```

Directives (one per line, the lines right above the fence, nothing between them and the fence):

* ``expect: TEXT``: TEXT (after the same substitutions as the block) appears in what the block printed (stdout and
  stderr). A block without ``expect`` must still exit with status 0.
* ``timeout: SECONDS``: the block's limit (default ``DEFAULT_TIMEOUT_S``).
* ``not-run: REASON [note]``: the block is not run; REASON is one of ``REASONS`` (a short list, on purpose).

How blocks run:

* A ``bash`` / ``sh`` / ``shell`` block is run by ``bash`` with ``set -eo pipefail``; a ``console`` block's commands
  are its lines starting with ``$ `` (and their ``\\`` continuation lines); the other lines are the output shown.
* ``criticalkv serve ...`` (not ``--setup`` / ``--write-repo`` / ``--help``) is a server: it is started in the
  background on free ports (``--http-port``, ``--grpc-port``, ``--metrics-port``, ``--openai-port`` added or
  replaced), the block waits for its ``ready:`` line, and it keeps running for the blocks after it in the same file:
  their ``localhost:9000``, ``127.0.0.1:8000``, ... name that server's ports. The same server command in two files is
  one server. A server stops (Ctrl-C, as a user stops it) once no block still to run talks to it, and when
  tests/test_docs.py ends.
* ``engines/NAME`` is built by the first block, README.md first and then docs/ in name order, whose command has
  ``--output engines/NAME``; a block that uses the engine runs that block first (once per test session). Engines and
  everything under ``/tmp/`` land in the session's temporary folder, not in the checkout.

Each block runs once per test session (``DocsRunner.run`` remembers what it printed), so other tests can read a
block's output instead of running the same command again (tests/runtime/test_bundled_parity.py reads the README's
first block).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The info strings of the blocks that are shell commands.
SHELL_LANGS = ("bash", "sh", "shell", "console")

#: Why a shell block may be left unrun: ``<!-- not-run: REASON -->`` on the line right before its fence.
REASONS = {
    "gpu": "needs a CUDA GPU",
    "tensorrt": "needs TensorRT",
    "cluster": "needs a multi-machine Ray cluster",
    "peer": "needs a peer's multi-GB environment (vLLM, kvpress, AIPerf, OpenVINO GenAI, ...)",
    "long": "takes more than a few minutes on 2 CPU cores",
}

DIRECTIVES = ("expect", "timeout", "not-run")
DEFAULT_TIMEOUT_S = 300
#: Triton's HTTP, gRPC and metrics ports and the OpenAI API's: ``criticalkv serve``'s defaults.
DEFAULT_PORTS = {"--http-port": 8000, "--grpc-port": 8001, "--metrics-port": 8002, "--openai-port": 9000}

HOW_TO_FIX = (f"Either make the command run as written on a fresh clone after the README's install (the suite "
              f"replaces only what tests/docs_blocks.py SUBSTITUTIONS lists), or put `<!-- not-run: REASON -->` on "
              f"the line right before the opening fence, REASON one of: "
              + ", ".join(f"{k} ({v})" for k, v in REASONS.items()) + ".")


@dataclass(frozen=True)
class Substitution:
    """``pattern`` (a regular expression) replaced by ``replacement`` in the blocks of the files matching ``files``
    (a glob relative to the repository root), and in their ``expect`` texts. ``{tmp}``: the session's temporary
    folder; ``{bin}``: the folder of the Python running the tests (its virtual environment's bin/)."""

    pattern: str
    replacement: str
    why: str
    files: str = "*"


#: What the suite changes in a documented command, and why: the one table. Ports of ``criticalkv serve`` are replaced
#: in code (free ports per server, DEFAULT_PORTS), as are engine directories built by another block (they are built
#: first). Add a row here, with its reason, when a documented command needs a smaller size or another path to run
#: in CI; keep the command a user reads unchanged otherwise.
SUBSTITUTIONS = [
    Substitution(r"\bbash scripts/install\.sh && ", "",
                 "the suite runs inside the environment scripts/install.sh made (.ci/run runs it first)"),
    Substitution(r"(?<![\w/.-])\.venv/bin/", "{bin}/",
                 "the virtual environment running the tests, wherever it is (VENV=... bash scripts/install.sh)"),
    Substitution(r"(?<![\w/.-])engines/", "{tmp}/engines/",
                 "engine directories land in the session's temporary folder, not in the checkout"),
    Substitution(r"(?<![\w.-])/tmp/", "{tmp}/tmp/", "scratch paths land in the session's temporary folder"),
    Substitution(r"bench gpu-serve --dry-run ", "bench gpu-serve --dry-run --policies full,criticalkv ",
                 "two of its five policies: the dry run checks the plumbing, the same for each (CI time)",
                 files="docs/torch_backend.md"),
]

#: The environment of every block (beside PATH, which starts with the tests' bin/): what the suite sets, and why
#: (``{tmp}``, ``{bin}`` as in SUBSTITUTIONS).
ENVIRONMENT = {
    "CRITICALKV_ORT_THREADS": ("1", "one ONNX Runtime thread: on CI's 2 shared cores one thread was measured several "
                                    "times faster than two (tests/runtime/test_bundled_parity.py)"),
    "CRITICALKV_OV_CACHE": ("{tmp}/openvino-cache", "OpenVINO's compiled-model cache (about 1.2 GB for the README's "
                                                    "engine) in the session's folder, not in the user's cache"),
    "PYTHONUNBUFFERED": ("1", "a server's `ready:` line arrives as it is printed"),
}


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    directives: tuple[tuple[str, str], ...] = ()
    index: int = 0  # the block's position among the file's shell blocks (1-based)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """The reason given by ``not-run`` (its first word), or None."""
        for key, value in self.directives:
            if key == "not-run":
                return value.split()[0] if value.split() else ""
        return None

    @property
    def expects(self) -> list[str]:
        return [value for key, value in self.directives if key == "expect"]

    @property
    def timeout(self) -> float:
        values = [value for key, value in self.directives if key == "timeout"]
        return float(values[-1]) if values else DEFAULT_TIMEOUT_S

    def where(self) -> str:
        return f"{self.path}:{self.line} (shell block {self.index} of {self.path}, ```{self.lang})"

    def commands(self) -> list[str]:
        """The block's logical command lines (``\\`` continuations joined), console prompts stripped."""
        lines = self.text.splitlines()
        if self.lang == "console":
            picked, cont = [], False
            for line in lines:
                if line.startswith("$ ") or cont:
                    picked.append(line[2:] if line.startswith("$ ") and not cont else line)
                    cont = line.rstrip().endswith("\\")
            lines = picked
        out, current = [], ""
        for line in lines:
            current += line
            if current.rstrip().endswith("\\"):
                current = current.rstrip()[:-1] + " "
                continue
            out.append(current)
            current = ""
        if current:
            out.append(current)
        return out


FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)")
COMMENT = re.compile(r"^\s*<!--\s*([A-Za-z-]+)\s*:\s*(.*?)\s*-->\s*$")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md, then docs/*.md by name."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse(path: Path, root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """(the shell blocks of ``path``, problems found while reading it: each names the file, line and what to do)."""
    rel = path.relative_to(root).as_posix()
    lines = path.read_text().splitlines()
    blocks, problems = [], []
    i, index = 0, 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        body = "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[i + 1:end])
        directives, j = [], i - 1
        while j >= 0 and COMMENT.match(lines[j]):
            key, value = COMMENT.match(lines[j]).groups()
            directives.insert(0, (key.lower(), value))
            j -= 1
        where = f"{rel}:{i + 1}"
        if lang in SHELL_LANGS:
            index += 1
            block = Block(rel, i + 1, lang, body, tuple(directives), index)
            problems += check_directives(block)
            blocks.append(block)
        else:
            first = next((line for line in body.splitlines() if line.strip()), "")
            if lang in ("", "text", "shell-session") and first.startswith("$ "):
                problems.append(f"{where}: a block of shell commands (`$ ` prompts) without an info string: label its "
                                f"fence ```console so that the suite runs it. {HOW_TO_FIX}")
            elif directives:
                problems.append(f"{where}: {', '.join(k for k, _ in directives)} on a ```{lang or '(no info string)'} "
                                "block: only shell blocks (bash, sh, shell, console) are run; remove the comment")
        # a marker separated from its fence by a blank or text line is not read: say so
        for k in range(max(0, j - 2), j + 1):
            if "not-run" in lines[k] and "<!--" in lines[k] and lang in SHELL_LANGS:
                problems.append(f"{rel}:{k + 1}: this not-run marker is not on the line right before the fence of "
                                f"line {i + 1} (nothing may stand between them), so it is not read")
        i = end + 1
    return blocks, problems


def check_directives(block: Block) -> list[str]:
    problems = []
    for key, value in block.directives:
        if key not in DIRECTIVES:
            problems.append(f"{block.where()}: unknown directive `<!-- {key}: ... -->`; the suite reads "
                            f"{', '.join(DIRECTIVES)} (tests/docs_blocks.py)")
        elif key == "timeout" and not re.fullmatch(r"\d+(\.\d+)?", value):
            problems.append(f"{block.where()}: `<!-- timeout: {value} -->` is not a number of seconds")
        elif key == "expect" and not value:
            problems.append(f"{block.where()}: an empty `<!-- expect: -->`")
    reason = block.not_run
    if reason is not None:
        if reason not in REASONS:
            problems.append(f"{block.where()}: `<!-- not-run: {reason} -->` is not one of the reasons the suite "
                            f"accepts: {', '.join(f'{k} ({v})' for k, v in REASONS.items())}. Make the command run "
                            "(tests/docs_blocks.py SUBSTITUTIONS for sizes, ports, paths) or give one of these")
        if block.expects:
            problems.append(f"{block.where()}: `expect` on a not-run block is never checked: remove it or run the "
                            "block")
    return problems


def collect(root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """Every shell block of the docs, in run order (README.md first), and every problem found."""
    blocks, problems = [], []
    for path in doc_files(root):
        found, issues = parse(path, root)
        blocks += found
        problems += issues
    return blocks, problems


SERVER = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?criticalkv\s+serve(?:\s|$)")
NOT_A_SERVER = re.compile(r"\s(--setup|--write-repo|--help|-h)(\s|$)")
ENGINE = re.compile(r"(?<![\w/.-])engines/([\w.-]+)")
OUTPUT_ENGINE = re.compile(r"--output\s+engines/([\w.-]+)")
HOST_PORT = re.compile(r"\b(localhost|127\.0\.0\.1):(\d+)\b")


def is_server(command: str) -> bool:
    return bool(SERVER.search(command)) and not NOT_A_SERVER.search(command)


class DocsFailure(AssertionError):
    pass


@dataclass
class Result:
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclass
class Server:
    command: str
    ports: dict[int, int]  # documented port -> the port it really listens on
    process: subprocess.Popen
    log: Path
    started_by: str

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DocsRunner:
    """Runs documented blocks once per session; keeps their servers until ``close``."""

    tmp: Path
    blocks: list[Block] = field(default_factory=list)
    results: dict[str, Result] = field(default_factory=dict)
    failures: dict[str, DocsFailure] = field(default_factory=dict)  # a block that failed fails every later call alike
    servers: dict[str, Server] = field(default_factory=dict)
    running: set = field(default_factory=set)

    def __post_init__(self):
        if not self.blocks:
            self.blocks, _ = collect()
        self.bin = Path(sys.executable).parent

    # ------------------------------------------------------------------ lookup
    def block(self, path: str, contains: str) -> Block:
        """The first runnable shell block of ``path`` whose text contains ``contains``."""
        for b in self.blocks:
            if b.path == path and contains in b.text and b.not_run is None:
                return b
        raise LookupError(f"no runnable shell block of {path} contains {contains!r}")

    def producer(self, engine: str) -> Block | None:
        """The first block whose command writes ``engines/<engine>`` (``--output engines/<engine>``)."""
        for b in self.blocks:
            if engine in OUTPUT_ENGINE.findall(b.text):
                return b
        return None

    # ------------------------------------------------------------------ substitution
    def substitute(self, block: Block, text: str) -> str:
        """``text`` after the SUBSTITUTIONS of ``block``'s file, in one pass (a replacement is never rewritten by
        another row: ``{tmp}`` may itself lie under /tmp/)."""
        subs = [sub for sub in SUBSTITUTIONS if sub.files == "*" or Path(block.path).match(sub.files)]
        if not subs:
            return text
        pattern = re.compile("|".join(f"(?P<s{i}>{sub.pattern})" for i, sub in enumerate(subs)))

        def replace(m: re.Match) -> str:
            sub = subs[int(m.lastgroup[1:])]
            return sub.replacement.format(tmp=self.tmp, bin=self.bin)

        return pattern.sub(replace, text)

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **{k: v.format(tmp=self.tmp, bin=self.bin) for k, (v, _) in ENVIRONMENT.items()}}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    # ------------------------------------------------------------------ running
    def run(self, block: Block) -> Result:
        """What ``block`` printed (run once per session; the blocks it depends on first)."""
        if block.id in self.failures:
            raise self.failures[block.id]
        if block.id in self.results:
            return self.results[block.id]
        if block.not_run is not None:
            raise DocsFailure(f"{block.where()} is marked not-run ({block.not_run}): it cannot be run")
        if block.id in self.running:
            raise DocsFailure(f"{block.where()} depends on itself (an engine it builds and uses?)")
        self.running.add(block.id)
        try:
            self._dependencies(block)
            result = self._run(block)
            self._check(block, result)
        except DocsFailure as failure:
            self.failures[block.id] = failure
            raise
        finally:
            self.running.discard(block.id)
        self.results[block.id] = result
        self._stop_servers_no_block_needs()
        return result

    def _check(self, block: Block, result: Result) -> None:
        missing = [e for e in block.expects if self._with_ports(block, self.substitute(block, e)) not in result.output]
        if missing:
            raise DocsFailure(f"{block.where()} ran but did not print what its `<!-- expect: ... -->` promises: "
                              f"{missing}. Its output (last 3000 characters):\n{result.output[-3000:]}\n"
                              "Fix the command or the doc's promise (the expect line right above the fence).")

    def _server_of(self, block: Block) -> str | None:
        """The server command (substituted) that ``block`` talks to or starts: its file's last one up to it."""
        found = None
        for b in self.blocks:
            if b.path == block.path and b.line <= block.line and b.not_run is None:
                for command in b.commands():
                    if is_server(command):
                        found = self.substitute(b, command)
        return found

    def _stop_servers_no_block_needs(self) -> None:
        """Stop the servers that no block still to run talks to (a Ray server of replicas holds GBs)."""
        needed = {self._server_of(b) for b in self.blocks if b.not_run is None and b.id not in self.results}
        for command in [c for c in self.servers if c not in needed]:
            self._stop(self.servers.pop(command))

    def _dependencies(self, block: Block) -> None:
        built_here = set(OUTPUT_ENGINE.findall(block.text))
        for engine in dict.fromkeys(ENGINE.findall(block.text)):
            if engine in built_here or (self.tmp / "engines" / engine / "manifest.json").is_file():
                continue
            producer = self.producer(engine)
            if producer is None or producer.not_run is not None:
                raise DocsFailure(
                    f"{block.where()} uses engines/{engine}, which no runnable block of README.md or docs/ builds "
                    f"(`--output engines/{engine}`)"
                    + (f": {producer.where()} builds it but is marked not-run ({producer.not_run})" if producer else "")
                    + ". Use an engine a runnable block builds (README.md builds engines/smollm2-criticalkv), or mark "
                      "this block not-run too.")
            self.run(producer)
        # a block that talks to a server of its file: that server first (it may have been started by an earlier block)
        if self._talks_to_server(block) and not any(is_server(c) for c in block.commands()):
            starter = self._server_block_before(block)
            if starter is None:
                raise DocsFailure(f"{block.where()} talks to a server (localhost / 127.0.0.1 ports) but no block of "
                                  f"{block.path} before it starts one (`criticalkv serve ...`): start one in an "
                                  "earlier block of the same file, or mark this block not-run")
            self.run(starter)

    def _talks_to_server(self, block: Block) -> bool:
        return any(int(port) in DEFAULT_PORTS.values() for _, port in HOST_PORT.findall(block.text))

    def _server_block_before(self, block: Block) -> Block | None:
        found = None
        for b in self.blocks:
            if b.path == block.path and b.line < block.line and b.not_run is None and any(
                    is_server(c) for c in b.commands()):
                found = b
        return found

    def _run(self, block: Block) -> Result:
        stdout, stderr = [], []
        segment: list[str] = []
        deadline = time.monotonic() + block.timeout
        for command in block.commands():
            if is_server(command):
                if segment:
                    self._bash(block, segment, stdout, stderr, deadline)
                    segment = []
                server = self._serve(block, command, deadline)
                stderr.append(server.output())
            else:
                segment.append(command)
        if segment:
            self._bash(block, segment, stdout, stderr, deadline)
        return Result("".join(stdout), "".join(stderr))

    def _with_ports(self, block: Block, text: str) -> str:
        """``text`` with the documented ports of ``block``'s server replaced by the ones it listens on."""
        if not HOST_PORT.search(text):
            return text
        command = self._server_of(block)
        if command is None or command not in self.servers or self.servers[command].process.poll() is not None:
            if self._talks_to_server(block):
                raise DocsFailure(f"{block.where()} talks to a server, but `{command}` is not running")
            return text
        ports = self.servers[command].ports
        return HOST_PORT.sub(lambda m: f"{m.group(1)}:{ports.get(int(m.group(2)), int(m.group(2)))}", text)

    def _bash(self, block: Block, commands: list[str], stdout: list, stderr: list, deadline: float) -> None:
        script = self._with_ports(block, self.substitute(block, "\n".join(commands)))
        left = deadline - time.monotonic()
        try:
            run = subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], cwd=ROOT, env=self.environment(),
                                 capture_output=True, text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired as err:
            raise DocsFailure(f"{block.where()} did not finish within its {block.timeout:.0f} s "
                              f"(`<!-- timeout: S -->` gives it more; mark it `<!-- not-run: long -->` if it needs "
                              f"minutes). Output so far:\n{_text(err.stdout)[-2000:]}{_text(err.stderr)[-2000:]}"
                              ) from None
        stdout.append(run.stdout)
        stderr.append(run.stderr)
        if run.returncode != 0:
            raise DocsFailure(f"{block.where()} failed with status {run.returncode}.\nThe script run (after "
                              f"substitutions):\n{script}\nstdout (last 2000 characters):\n{run.stdout[-2000:]}\n"
                              f"stderr (last 3000 characters):\n{run.stderr[-3000:]}\n{HOW_TO_FIX}")

    def _serve(self, block: Block, command: str, deadline: float) -> Server:
        command = self.substitute(block, command)
        if command in self.servers and self.servers[command].process.poll() is None:
            return self.servers[command]
        ports, args = {}, command
        for option, default in DEFAULT_PORTS.items():
            port = free_port()
            m = re.search(rf"{option}[ =](\d+)", args)
            if m:
                ports[int(m.group(1))] = port
                args = args[:m.start()] + f"{option} {port}" + args[m.end():]
            else:
                ports[default] = port
                args += f" {option} {port}"
        log = self.tmp / f"server-{len(self.servers) + 1}.log"
        with open(log, "w") as out:
            process = subprocess.Popen(["bash", "-c", args], cwd=ROOT, env=self.environment(), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        server = Server(command, ports, process, log, block.id)
        self.servers[command] = server
        while "ready:" not in server.output():
            if process.poll() is not None:
                raise DocsFailure(f"{block.where()}: `{command}` exited with status {process.returncode} before "
                                  f"printing `ready:`:\n{server.output()[-3000:]}\n{HOW_TO_FIX}")
            if time.monotonic() > deadline:
                raise DocsFailure(f"{block.where()}: `{command}` printed no `ready:` within {block.timeout:.0f} s:\n"
                                  f"{server.output()[-3000:]}")
            time.sleep(0.5)
        return server

    def _stop(self, server: Server) -> str | None:
        """Ctrl-C to the server's process group (as a user stops it), SIGKILL after 60 s; a problem, or None."""
        process = server.process
        if process.poll() is not None:
            return None
        try:
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            return f"`{server.command}` (started by {server.started_by}) ignored Ctrl-C for 60 s"
        except ProcessLookupError:
            pass
        return None

    def close(self) -> list[str]:
        """Stop every server; what did not stop cleanly."""
        problems = [p for p in map(self._stop, self.servers.values()) if p]
        self.servers.clear()
        return problems


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def which(program: str) -> bool:
    return shutil.which(program) is not None
