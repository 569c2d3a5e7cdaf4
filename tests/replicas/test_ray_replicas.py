"""`criticalkv serve --replicas 2` as a user runs it: a real local Ray started by the launcher, two engine replicas
(tiny model) behind the OpenAI-compatible API the launcher serves itself, ContextAffinityRouter and the shared context
store; driven by the official `openai` client and plain HTTP. One Ray for the module, stopped with Ctrl-C by its last
test; then one more launch for the deadline and a SIGKILLed launcher.

What is checked: the engine's greedy text through both endpoints (streaming and not) and the same 400s as `criticalkv
serve`; every listening socket on loopback; 12 questions at once about a new document, three times, all answered and
counted where they ran; the API's edges (a 20 MB body, a short body, no model, token ids); a document's questions go
to the replica that compressed it (compressed once); a replica SIGKILLed with four streams in flight ends each with an
answer or OpenAI's error object within 30 s, its contexts are then answered from the store, and Ray Serve replaces it
within 60 s; Ctrl-C ends a stream with the 503 error, prints none of Ray's noise and leaves no process; a request past
--request-timeout gets a 504; a SIGKILLed launcher leaves no process after 10 s."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from criticalkv.chat import chat_input_ids
from serving.servers import MODEL, build_tiny_engine, random_words

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")
pytest.importorskip("ray.serve")

LONG = 20000  # tokens: a stream this long is still running when a test kills its replica


class Replicas:
    """A `criticalkv serve --replicas 2` process (stdout read by a thread) and the engine it serves."""

    def __init__(self, engine_dir: Path, tmp: Path, replicas: int = 2, extra=()):
        from criticalkv.runtime import Engine
        from criticalkv.serving.launcher import free_port

        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "criticalkv.cli", "serve", "--engine-dir", str(engine_dir), "--replicas",
             str(replicas), "--openai-port", str(self.port), "--threads", "1", "--prefill-chunk", "0",
             "--context-cache-dtype", "float32", *extra],  # exact context copies: answers equal engine.generate's
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "TMPDIR": str(tmp)})
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 300
        while not self.ready.wait(0.2):
            assert self.process.poll() is None, "criticalkv serve --replicas exited:\n" + "".join(self.lines)
            assert time.monotonic() < deadline, "criticalkv serve --replicas not ready:\n" + "".join(self.lines)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.engine = Engine.load(engine_dir, threads=1)

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("ready:"):
                self.ready.set()

    def post(self, path, body):
        request = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def replicas(self):
        """GET /replicas: the replicas' current reports (stale ones dropped), the store and the router."""
        with urllib.request.urlopen(f"{self.url}/replicas", timeout=30) as response:
            state = json.loads(response.read())
        state["live"] = [r for r in state["replicas"] if not r["stale"]]
        return state

    def settled(self, check, timeout=30.0):
        """The /replicas state once ``check(state)`` holds (reports arrive every second)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.replicas()
            if check(state) or time.monotonic() > deadline:
                return state
            time.sleep(0.3)

    def answer(self, context_ids, question_ids, max_tokens):
        tokens = self.engine.generate([context_ids], max_tokens, questions=[question_ids]).tokens[0]
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = build_tiny_engine(tmp_path_factory.mktemp("engine"), max_batch_size=4, max_new_tokens=LONG)
    launched = Replicas(engine, tmp_path_factory.mktemp("tmp"))
    yield launched
    launched.engine.close()
    if launched.process.poll() is None:  # a test failed before the last one stopped it: stop it, by force if need be
        family = psutil.Process(launched.process.pid).children(recursive=True)
        launched.process.send_signal(signal.SIGINT)
        try:
            launched.process.wait(120)
        except subprocess.TimeoutExpired:
            for process in [launched.process, *family]:
                try:
                    process.kill()
                except (ProcessLookupError, psutil.NoSuchProcess):
                    pass


def stream_events(url, body, events, started):
    """POST a streaming completion; every SSE event (parsed) into ``events``; ``started`` set at the first one."""
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
    except Exception as err:  # the test asserts on what arrived
        events.append(f"{type(err).__name__}: {err}")
    finally:
        events.append(("ended", time.monotonic()))
        started.set()


def test_the_openai_client_gets_the_engines_text_and_the_same_errors(served):
    tokenizer = served.engine.tokenizer
    text, _ = random_words(40, seed=1)
    messages = [{"role": "user", "content": text}]
    expected = served.engine.generate([chat_input_ids(tokenizer, messages)], 6).tokens[0]
    expected = tokenizer.decode(expected, skip_special_tokens=True)
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(chat_input_ids(tokenizer, messages))
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 6
    prompt, ids = random_words(12, seed=2)
    completion = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert completion.choices[0].text == tokenizer.decode(served.engine.generate([ids], 5).tokens[0],
                                                          skip_special_tokens=True)
    # the errors of `criticalkv serve`: OpenAI's object, 400 naming the field, the service goes on
    status, body = served.post("/v1/completions", {"model": MODEL, "prompt": "w5", "max_token": 3})
    assert status == 400 and body["error"]["message"].startswith("max_token: unknown field")
    status, body = served.post("/v1/completions", {"model": "other", "prompt": "w5"})
    assert status == 400 and body["error"]["param"] == "model"
    status, body = served.post("/v1/completions", {"model": MODEL, "prompt": "w5", "kv_budget": 1})
    assert status == 400 and body["error"]["param"] == "kv_budget"
    status, body = served.post("/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_every_listening_socket_of_the_launchers_processes_is_on_loopback(served):
    """--host 127.0.0.1 (the default): Ray's head processes, its agents, the replicas, the store and the API listen
    on loopback only (and there is no Serve HTTP proxy)."""
    family = [psutil.Process(served.process.pid), *psutil.Process(served.process.pid).children(recursive=True)]
    pids = {p.pid: p for p in family}
    listening = [(c.laddr.ip, c.laddr.port, pids[c.pid].name()) for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    outside = [s for s in listening if s[0].removeprefix("::ffff:") not in ("127.0.0.1", "::1")]
    assert len(listening) >= 5 and not outside, (outside, listening)
    assert ("127.0.0.1", served.port) in {(ip, port) for ip, port, _ in listening}
    assert not any("ProxyActor" in p.name() for p in family)


def test_twelve_questions_about_a_new_document_at_once_are_all_answered_and_counted(served):
    """The sequence that once lost a request (a new document, then 12 questions about it at once through the openai
    client), three times: every request answered within the deadline; the frontend's requests = the replicas'
    requests; each context request is one hit or miss of a replica's context cache; nothing left in flight."""
    from concurrent.futures import ThreadPoolExecutor

    def totals():
        state = served.replicas()
        live = state["live"]
        return (state["ingress"]["requests"], sum(r["requests"] for r in live),
                sum(r["context_cache"]["hits"] + r["context_cache"]["misses"] for r in live), len(live))

    served.settled(lambda s: len(s["live"]) == 2, timeout=60)
    time.sleep(2.5)  # the replicas report every second: by now their counts include every request before this test
    before = totals()
    for round_ in range(3):
        doc, _ = random_words(150, seed=60 + round_)

        def ask(i):
            started = time.monotonic()
            out = served.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": random_words(5, seed=100 * round_ + i)[0]}],
                max_tokens=6, extra_body={"context": doc}, timeout=90)
            return out.model_extra["context_cache_hit"], time.monotonic() - started

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        assert all(seconds < 60 for _, seconds in answers), answers
        assert sum(not hit for hit, _ in answers) <= 2, answers  # compressed once (twice if the holder was too busy)
    time.sleep(2.5)
    state = served.replicas()
    after = totals()
    assert after[0] - before[0] == after[1] - before[1] == 36 and after[2] - before[2] == 36, (before, after, state)
    assert not state["ingress"]["in_flight"] and not any(r["in_flight"] for r in state["live"]), state


def test_the_api_edges_are_the_single_servers(served):
    """The same frontend as `criticalkv serve`: a 20 MB body written whole by http.client gets a 413 it reads within
    a second; a body shorter than its Content-Length gets a 400 once it stops arriving; a missing model and token-id
    prompts get 400s naming them."""
    import http.client
    import socket

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w5 " * 6_700_000}]}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    started = time.monotonic()
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    out = json.loads(response.read())
    elapsed = time.monotonic() - started
    connection.close()
    assert response.status == 413 and out["error"]["code"] == 413 and elapsed < 1.0, (out, elapsed)
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": \"criticalkv\"")
        response = http.client.HTTPResponse(sock)
        response.begin()
        out = json.loads(response.read())
    assert response.status == 400 and out["error"]["message"].startswith("the request body stopped arriving"), out
    status, out = served.post("/v1/completions", {"prompt": "w5"})
    assert status == 400 and out["error"]["param"] == "model" and "required" in out["error"]["message"], out
    status, out = served.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7]})
    assert status == 400 and out["error"]["message"].startswith("prompt: token ids are not taken here"), out


def test_questions_about_a_document_go_to_the_replica_that_compressed_it(served):
    from criticalkv.chat import encode_text
    from criticalkv.replicas.store import route_digest
    from criticalkv.serving.context_cache import context_key

    tokenizer = served.engine.tokenizer
    puts = served.replicas()["store"]["puts"]
    for doc_seed in (10, 11):
        doc, _ = random_words(150, seed=doc_seed)
        digest = route_digest(context_key(encode_text(tokenizer, doc), "", None)[0])
        hits = []
        for q in range(3):
            question, _ = random_words(5, seed=doc_seed * 10 + q)
            status, out = served.post("/v1/completions", {"model": MODEL, "prompt": question, "max_tokens": 4,
                                                          "context": doc})
            assert status == 200, out
            hits.append(out["context_cache_hit"])
            if q == 2:
                ids = encode_text(tokenizer, question, special=False)
                assert out["choices"][0]["text"] == served.answer(encode_text(tokenizer, doc), ids, 4)
        assert hits == [False, True, True]  # compressed once, on the replica its questions then went to
        state = served.settled(lambda s: any(digest in r["contexts"] for r in s["live"]))
        assert sum(digest in r["contexts"] for r in state["live"]) == 1, state
    state = served.settled(lambda s: s["store"]["puts"] >= puts + 2)
    assert state["store"]["puts"] == puts + 2  # each document compressed once, published once
    assert state["router"]["affinity"] >= 4, state["router"]


def test_a_killed_replica_ends_its_requests_and_its_contexts_come_from_the_store(served):
    from criticalkv.chat import encode_text
    from criticalkv.replicas.store import route_digest
    from criticalkv.serving.context_cache import context_key

    tokenizer = served.engine.tokenizer
    doc, _ = random_words(150, seed=30)
    digest = route_digest(context_key(encode_text(tokenizer, doc), "", None)[0])
    status, out = served.post("/v1/completions", {"model": MODEL, "prompt": "w9", "max_tokens": 2, "context": doc})
    assert status == 200 and out["context_cache_hit"] is False
    state = served.settled(lambda s: any(digest in r["contexts"] for r in s["live"]) and len(s["live"]) == 2)
    holder = next(r for r in state["live"] if digest in r["contexts"])
    # four streams on that document: the router sends them to the holder
    runs = [([], threading.Event()) for _ in range(4)]
    threads = [threading.Thread(target=stream_events, daemon=True, args=(served.url, {
        "model": MODEL, "prompt": random_words(4, seed=40 + i)[0], "max_tokens": LONG, "ignore_eos": True,
        "stream": True, "context": doc}, *runs[i])) for i in range(4)]
    for thread in threads:
        thread.start()
    for events, started in runs:
        assert started.wait(60)
    killed = time.monotonic()
    os.kill(holder["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(30 + 5)
    for events, _ in runs:
        ended = events[-1]
        assert ended[0] == "ended" and ended[1] - killed <= 30, events[-3:]
        last = [e for e in events[:-1] if isinstance(e, dict)][-1]
        if "error" in last:  # the stream ends with OpenAI's error object, then [DONE]
            assert last["error"]["code"] == 503 and "replica" in last["error"]["message"] and events[-2] == "[DONE]"
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert any("error" in e for events, _ in runs for e in events if isinstance(e, dict))
    # served again at once, from the other replica, the document loaded from the store (not compressed again)
    puts = served.replicas()["store"]["puts"]
    question = random_words(5, seed=50)[0]
    status, out = served.post("/v1/completions", {"model": MODEL, "prompt": question, "max_tokens": 4, "context": doc})
    assert status == 200 and out["context_cache_hit"] is True
    assert time.monotonic() - killed < 60
    ids = encode_text(tokenizer, question, special=False)
    assert out["choices"][0]["text"] == served.answer(encode_text(tokenizer, doc), ids, 4)
    state = served.settled(lambda s: len(s["live"]) == 2 and holder["pid"] not in [r["pid"] for r in s["live"]],
                           timeout=60)
    live = state["live"]
    assert len(live) == 2 and holder["pid"] not in [r["pid"] for r in live], live  # Ray Serve replaced it
    assert time.monotonic() - killed <= 60 + 5
    assert sum(r["store_loads"] for r in live) >= 1 and state["store"]["puts"] == puts


def test_ctrl_c_ends_the_streams_with_503_and_stops_everything(served):
    descendants = psutil.Process(served.process.pid).children(recursive=True)
    assert len(descendants) >= 4  # Ray's processes and the replicas
    events, started = [], threading.Event()
    thread = threading.Thread(target=stream_events, daemon=True, args=(served.url, {
        "model": MODEL, "prompt": "w5 w6", "max_tokens": LONG, "ignore_eos": True, "stream": True}, events, started))
    thread.start()
    assert started.wait(60)
    served.process.send_signal(signal.SIGINT)
    thread.join(30)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors, events[-3:]
    assert errors[-1]["error"]["code"] == 503 and "shutting down" in errors[-1]["error"]["message"], errors[-1]
    assert served.process.wait(120) == 0, "".join(served.lines[-20:])
    noise = [line for line in served.lines if "Connecting to existing Serve app" in line
             or "graceful_shutdown" in line or "Task exception was never retrieved" in line
             or "Token authentication is enabled" in line]
    assert not noise, noise

    def remaining():
        return [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + 30
    while remaining() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = remaining()
    assert not left, [(p.pid, p.name()) for p in left]


def test_replica_flags_are_checked_before_anything_starts(tmp_path, capsys):
    from criticalkv.cli import main

    assert main(["serve", "--replicas", "2", "--repo", str(tmp_path)]) == 2
    assert "--repo is a Triton model repository" in capsys.readouterr().err
    assert main(["serve", "--replicas", "0", "--engine-dir", str(tmp_path)]) == 2
    assert "--replicas must be" in capsys.readouterr().err
    # the deployment's advanced settings: one spec, each key checked
    with pytest.raises(SystemExit):
        main(["serve", "--replicas", "2", "--engine-dir", str(tmp_path), "--replica-options", "routr=pow2"])
    assert "KEY one of router, imbalance_threshold" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--engine-dir", str(tmp_path), "--replica-options",
                 "router=random"]) == 2
    assert "--replica-options router must be affinity or pow2" in capsys.readouterr().err


def test_a_request_past_the_deadline_gets_504_and_a_killed_launcher_leaves_no_process(tmp_path_factory):
    """Another `criticalkv serve --replicas 1`, with --request-timeout 3: a completion that would take longer is
    cancelled and answered with OpenAI's 504 error object, and its replica frees the slot. Then the launcher is
    SIGKILLed: its watchdog kills every process of its local Ray (Ray's own agents would stay about a minute), within
    10 s."""
    engine = build_tiny_engine(tmp_path_factory.mktemp("engine"), max_batch_size=2, max_new_tokens=LONG)
    launched = Replicas(engine, tmp_path_factory.mktemp("tmp"), replicas=1, extra=["--request-timeout", "3"])
    try:
        started = time.monotonic()
        status, out = launched.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": LONG,
                                                        "ignore_eos": True})
        elapsed = time.monotonic() - started
        assert status == 504 and out["error"]["type"] == "timeout", out
        assert out["error"]["message"].startswith("no answer within the server's request timeout (3 s"), out
        assert 2.5 < elapsed < 15, elapsed
        state = launched.settled(lambda s: s["live"] and s["live"][0]["running"] == 0 and not s["live"][0]["in_flight"])
        assert state["live"][0]["running"] == 0 and not state["ingress"]["in_flight"], state
        # the cancelled request's handle leaves no unretrieved exception behind (asyncio's traceback on the console)
        assert not any("Task exception was never retrieved" in line for line in launched.lines), launched.lines
    finally:
        family = psutil.Process(launched.process.pid).children(recursive=True)
        launched.engine.close()
        assert any(p.name().startswith("ray::") for p in family) and len(family) >= 5
        launched.process.kill()
        launched.process.wait(10)
        killed = time.monotonic()
        gone, alive = psutil.wait_procs(family, timeout=10)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, p.name()) for p in alive]
        assert time.monotonic() - killed <= 10 + 1
