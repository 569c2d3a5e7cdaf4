"""`criticalkv serve` as a user runs it (the launcher in its own process, tritonserver, the OpenAI-compatible
API in front) on a tiny-model engine, driven by the official `openai` client: the same greedy text as
`criticalkv generate --chat`, streaming and not, usage, bad requests, the API key, a client that goes away,
taken ports, and a launcher killed by SIGKILL taking its server with it.

One server for the module (max_num_seqs 1, so that one long stream holds the only slot); the last test
kills it."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from criticalkv.chat import chat_input_ids
from criticalkv.cli import main
from serving.servers import MODEL, build_tiny_engine, random_words

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

KEY = "test-key-7481"
LONG = 20000  # tokens: a long stream holds its slot far longer than these tests wait
DEADLINE = 12  # seconds: the server's --request-timeout (a request waiting behind a long stream meets it)


class Launched:
    """A `criticalkv serve` process (its stdout read by a thread) and the engine it serves."""

    def __init__(self, engine_dir: Path, tmp: Path):
        from criticalkv.runtime import Engine
        from criticalkv.serving.launcher import free_port

        self.engine_dir, self.tmp = engine_dir, tmp
        self.ports = {flag: free_port() for flag in ("--http-port", "--grpc-port", "--metrics-port", "--openai-port")}
        args = [a for flag, port in self.ports.items() for a in (flag, str(port))]
        env = {**os.environ, "TMPDIR": str(tmp), "CRITICALKV_API_KEY": KEY}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "criticalkv.cli", "serve", "--engine-dir", str(engine_dir), *args,
             "--threads", "1", "--max-num-seqs", "1", "--request-timeout", str(DEADLINE),
             "--context-cache-dtype", "float32"],  # exact context copies: answers equal engine.generate's
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 240
        while not self.ready.wait(0.2):
            assert self.process.poll() is None, "criticalkv serve exited:\n" + "".join(self.lines)
            assert time.monotonic() < deadline, "criticalkv serve not ready:\n" + "".join(self.lines)
        self.base_url = f"http://127.0.0.1:{self.ports['--openai-port']}/v1"
        self.client = openai.OpenAI(base_url=self.base_url, api_key=KEY, max_retries=0, timeout=120)
        self.engine = Engine.load(engine_dir, threads=1)

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("ready:"):
                self.ready.set()

    def post(self, path, body, headers=None):
        """(status, JSON body) of a raw POST to the OpenAI API (with the key unless ``headers`` says)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"} if headers is None else headers
        request = urllib.request.Request(f"{self.base_url}{path}", data, headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def expected(self, ids, max_tokens):
        tokens = self.engine.generate([ids], max_new_tokens=max_tokens).tokens[0]
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self):
        self.engine.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            assert self.process.wait(60) == 0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from criticalkv.serving import launcher

    if not launcher.is_set_up():
        pytest.fail("tritonserver is not set up: run `criticalkv serve --setup` (scripts/install.sh does)")
    engine = build_tiny_engine(tmp_path_factory.mktemp("engine"), max_batch_size=1, max_new_tokens=LONG)
    launched = Launched(engine, tmp_path_factory.mktemp("tmp"))
    yield launched
    launched.close()


def generate_cli(capsys, engine_dir, text, max_tokens, chat):
    """`criticalkv generate --engine-dir ... [--chat] --json` run here: its JSON."""
    capsys.readouterr()
    assert main(["generate", "--engine-dir", str(engine_dir), "--prompt", text, "--max-new-tokens", str(max_tokens),
                 "--json", *(["--chat"] if chat else [])]) == 0
    return json.loads(capsys.readouterr().out)


def test_chat_completions_give_the_text_of_generate_chat(served, capsys):
    text, _ = random_words(120, seed=11)
    cli = generate_cli(capsys, served.engine_dir, text, 12, chat=True)
    assert cli["text"]
    messages = [{"role": "user", "content": text}]
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    choice = out.choices[0]
    assert choice.message.content == cli["text"] and choice.message.role == "assistant"
    assert choice.finish_reason == ("length" if cli["new_tokens"] == 12 else "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (cli["prompt_tokens"], cli["new_tokens"])
    assert out.object == "chat.completion" and out.model == MODEL and out.id.startswith("chatcmpl-")
    # streaming, with the usage chunk; max_completion_tokens is the newer name of max_tokens
    chunks = list(served.client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cli["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == cli["new_tokens"]
    assert chunks[-1].usage.prompt_tokens == cli["prompt_tokens"]
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_and_models(served, capsys):
    text, _ = random_words(80, seed=12)
    cli = generate_cli(capsys, served.engine_dir, text, 9, chat=False)
    out = served.client.completions.create(model=MODEL, prompt=text, max_tokens=9)
    assert out.choices[0].text == cli["text"] and out.usage.completion_tokens == cli["new_tokens"]
    stream = served.client.completions.create(model=MODEL, prompt=text, max_tokens=9, stream=True)
    assert "".join(c.choices[0].text for c in stream) == cli["text"]
    echo = served.client.completions.create(model=MODEL, prompt=text, max_tokens=9, echo=True)
    assert echo.choices[0].text == text + cli["text"]
    assert [m.id for m in served.client.models.list()] == [MODEL]


def test_a_conversation_uses_the_chat_template_and_criticalkv_fields(served):
    messages = [{"role": "system", "content": random_words(30, 13)[0]},
                {"role": "user", "content": random_words(60, 14)[0]},
                {"role": "assistant", "content": random_words(20, 15)[0]},
                {"role": "user", "content": [{"type": "text", "text": random_words(40, 16)[0]}]}]
    template_messages = [dict(m, content=m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
                         for m in messages]
    ids = chat_input_ids(served.engine.tokenizer, template_messages)
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=3,
                                                extra_body={"kv_budget": 40})
    assert out.choices[0].message.content == served.expected(ids, 10)
    assert out.usage.prompt_tokens == len(ids)
    # ignore_eos (as vLLM): exactly max_tokens tokens
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=25,
                                                extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 25 and out.choices[0].finish_reason == "length"


BAD = [  # (path, body, status, what the message names)
    ("/chat/completions", b'{"model": "criticalkv", "messages": [', 400, "not valid JSON"),
    ("/chat/completions", b'["not", "an object"]', 400, "must be a JSON object"),
    ("/chat/completions", {"model": MODEL}, 400, "messages: required"),
    ("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "w5"}]}, 400,
     "model 'gpt-4o' does not exist"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "temperature": "0.5"}, 400,
     "temperature: Input should be a valid number"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 0}, 400,
     "max_tokens must be >= 1"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": LONG + 1}, 400,
     rf"max_tokens must lie in \[1, {LONG}\]"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "temperature": -1}, 400, "temperature"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "top_p": 0}, 400, "top_p"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "n": 2}, 400, "only n=1"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "kv_budget": 41}, 400,
     r"kv_budget must lie in \[8, 40\]"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "context": 5}, 400, "context"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "context": ""}, 400,
     "context: a non-empty string"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_token": 3}, 400,
     "max_token: unknown field"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "presence_penalty": 0.5}, 400,
     "presence_penalty: not supported"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "w5"}]}, 400, "messages.0.role"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "stream_options": {"include_usage": True}},
     400, "stream_options: only allowed when stream is true"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["w5"] * 300)}]}, 400,
     "more than the engine's max input length 256"),
    ("/completions", {"model": MODEL, "prompt": ["w5", "w6"]}, 400, "one prompt per request"),
    ("/completions", {"model": MODEL, "prompt": "", "stream": True}, 400, "the prompt is empty"),
    ("/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 2.5}, 400, "max_tokens: Input should be a valid integer"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}, 400,
     rf"model: required \(this server serves '{MODEL}': GET /v1/models\)"),
    ("/completions", {"model": MODEL, "prompt": [5, 6, 7]}, 400, "prompt: token ids are not taken here"),
    ("/completions", {"model": MODEL, "prompt": [[5, 6], [7]]}, 400, "prompt: token ids are not taken here"),
]


def test_bad_requests_get_400_naming_the_problem_and_the_server_keeps_serving(served):
    for path, body, status, message in BAD:
        code, out = served.post(path, body)
        assert code == status and re.search(message, out["error"]["message"]), (body, out)
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["code"] == status
    for kv_budget in (41, 7, -5, 10000):  # one message with the engine's range, and OpenAI's param names the field
        code, out = served.post("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                                                      "kv_budget": kv_budget})
        assert code == 400 and out["error"]["param"] == "kv_budget", out
        assert re.fullmatch(rf"kv_budget must lie in \[8, 40\] \([^)]*\), got {kv_budget}", out["error"]["message"]), out
    with pytest.raises(openai.BadRequestError, match="kv_budget must lie in"):  # the client's own error class
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}],
                                              extra_body={"kv_budget": 7})
    code, out = served.post("/nothing", {})
    assert code == 404 and "no such endpoint" in out["error"]["message"]
    text, ids = random_words(30, seed=17)  # still serving
    out = served.client.completions.create(model=MODEL, prompt=text, max_tokens=4)
    assert out.choices[0].text == served.expected(ids, 4)


def _raw_exchange(port, head: bytes, body: bytes = b"") -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of one HTTP exchange written by hand: ``head`` (request line and headers), then
    ``body`` as it is, then nothing more; the answer is read as soon as it comes."""
    import http.client

    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        started = time.monotonic()
        sock.sendall(head + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read()), time.monotonic() - started


def test_bodies_too_large_or_not_json_are_refused_before_they_are_read(served):
    """The body limit (by default what the engine's max input length can need) is checked from the headers: a
    20 MB Content-Length gets 413 while no byte of the body was sent; a chunked body gets 413 once it passes the
    limit; a body that is not JSON gets 415. OpenAI's error object each time, and the server keeps serving."""
    from criticalkv.request import TextBound

    limit = TextBound.of(served.engine.tokenizer, served.engine.max_input_len).max_body_bytes
    port = served.ports["--openai-port"]
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    status, out, _ = _raw_exchange(port, f"{head}Content-Length: 20000000\r\n\r\n".encode())  # no body sent
    assert status == 413 and out["error"]["code"] == 413 and out["error"]["type"] == "invalid_request_error", out
    assert out["error"]["message"].startswith(f"the request body is 20000000 bytes, more than this server takes "
                                              f"({limit} bytes"), out
    chunk = b"x" * 65536
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(limit // len(chunk) + 1))
    status, out, _ = _raw_exchange(port, f"{head}Transfer-Encoding: chunked\r\n\r\n".encode(), chunks)
    assert status == 413 and f"passed {limit} bytes" in out["error"]["message"], out
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        code, out = served.post("/chat/completions", {"messages": [{"role": "user", "content": "w5"}]},
                                headers={"Authorization": f"Bearer {KEY}", "Content-Type": content_type})
        assert code == 415 and out["error"]["message"] == (
            f"the request body must be JSON (Content-Type: application/json), got Content-Type '{content_type}'"), out
    code, out = served.post("/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 2},
                            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json; charset=utf-8"})
    assert code == 200, out


def test_a_body_the_client_is_still_writing_gets_a_413_it_can_read(served):
    """Python's http.client writes its whole body before it reads: a 20 MB chat gets its 413 (OpenAI's error object)
    within a second, not a reset connection; a body shorter than its Content-Length, its client waiting, gets a 400
    naming what came once it stops arriving (10 s), not silence."""
    import http.client

    port = served.ports["--openai-port"]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w5 " * 6_700_000}]}).encode()
    assert len(body) > 20_000_000
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    started = time.monotonic()
    connection.request("POST", "/v1/chat/completions", body,
                       {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = connection.getresponse()
    out = json.loads(response.read())
    elapsed = time.monotonic() - started
    connection.close()
    assert response.status == 413 and out["error"]["code"] == 413, out
    assert elapsed < 1.0, f"the 413 took {elapsed:.2f} s"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    status, out, seconds = _raw_exchange(port, head, b'{"model": "criticalkv"')
    assert status == 400 and out["error"]["type"] == "invalid_request_error", out
    assert out["error"]["message"] == ("the request body stopped arriving: 22 bytes of its Content-Length 100 came, "
                                       "then nothing for 10 s"), out
    assert 9 < seconds < 30


def test_a_request_past_the_deadline_gets_504_and_its_slot_back(served):
    """--request-timeout: a request still without an answer after it (here: waiting behind a long stream that holds
    the only slot) is cancelled and answered with an error, 504 with OpenAI's error object on the OpenAI API, the
    model's error on Triton's own endpoint; the stream goes on (its tokens keep coming) until its client closes it."""
    long = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": random_words(40, 25)[0]}], max_tokens=LONG, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(long)
    for _ in range(4):
        next(chunks)
    results = {}

    def openai_request():
        started = time.monotonic()
        results["openai"] = (*served.post("/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4}),
                             time.monotonic() - started)

    def triton_request():
        url = f"http://127.0.0.1:{served.ports['--http-port']}/v2/models/{MODEL}/generate"
        started = time.monotonic()
        try:
            urllib.request.urlopen(urllib.request.Request(url, json.dumps({"text_input": "w5", "max_tokens": 2}).encode()),
                                   timeout=120)
            results["triton"] = (200, "", time.monotonic() - started)
        except urllib.error.HTTPError as err:
            results["triton"] = (err.code, err.read().decode(), time.monotonic() - started)

    threads = [threading.Thread(target=f) for f in (openai_request, triton_request)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE + 60)
    status, out, seconds = results["openai"]
    assert status == 504 and out["error"]["type"] == "timeout" and out["error"]["code"] == 504, out
    assert out["error"]["message"].startswith(f"no answer within the server's request timeout ({DEADLINE} s"), out
    assert DEADLINE - 1 < seconds < DEADLINE + 15
    status, text, seconds = results["triton"]
    assert status != 200 and "no answer within the server's request timeout" in text, (status, text)
    assert DEADLINE - 1 < seconds < DEADLINE + 15
    next(chunks)  # the stream still runs
    long.close()
    text, ids = random_words(30, seed=26)  # the slot is free again
    assert served.client.completions.create(model=MODEL, prompt=text, max_tokens=4).choices[0].text == \
        served.expected(ids, 4)


def test_texts_beyond_the_engine_are_refused_before_the_template_and_the_tokenizer(served):
    """More characters (whitespace apart) than the max input length can hold: 400 naming the characters (the
    tokenizer would have said tokens), on both APIs; more messages than tokens too."""
    from criticalkv.request import TextBound

    bound = TextBound.of(served.engine.tokenizer, served.engine.max_input_len)
    assert bound.max_chars == 256 * len("lighthouse")
    over = "w5" * (bound.max_chars // 2 + 1)
    tail = f"characters (whitespace apart), more than the engine takes: at most {bound.max_chars} (its max input length"
    for path, body, message in (
            ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": over}]},
             f"the messages: {len(over)} {tail}"),
            ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "context": over},
             f"the messages and the context: {len(over) + 2} {tail}"),
            ("/completions", {"model": MODEL, "prompt": over}, f"the prompt: {len(over)} {tail}")):
        code, out = served.post(path, body)
        assert code == 400 and out["error"]["message"].startswith(message), (path, out)
    code, out = served.post("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}] * 257})
    assert code == 400 and out["error"]["message"] == (
        "messages: 257 messages, more than the engine's max input length (256 tokens)"), out
    # Triton's own endpoint: the model checks the characters before it tokenises
    url = f"http://127.0.0.1:{served.ports['--http-port']}/v2/models/{MODEL}/generate"
    request = urllib.request.Request(url, json.dumps({"text_input": over, "max_tokens": 2}).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=120)
    assert refused.value.code == 400
    assert f"text_input: {len(over)} {tail}" in refused.value.read().decode()
    text, ids = random_words(30, seed=31)  # still serving
    assert served.client.completions.create(model=MODEL, prompt=text, max_tokens=4).choices[0].text == \
        served.expected(ids, 4)


def test_the_api_key_is_required(served):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        code, out = served.post("/chat/completions", body, headers={"Content-Type": "application/json", **headers})
        assert code == 401 and "API key" in out["error"]["message"], out
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.base_url, api_key="wrong", max_retries=0).models.list()
    assert served.post("/chat/completions", body)[0] == 200
    with urllib.request.urlopen(served.base_url.removesuffix("/v1") + "/health", timeout=30) as response:
        assert response.status == 200  # as vLLM: /health needs no key
    # the ready banner shows the key as it was given: here $CRITICALKV_API_KEY (a --api-key value is never printed)
    assert any('-H "Authorization: Bearer $CRITICALKV_API_KEY"' in line for line in served.lines)
    assert not any(KEY in line for line in served.lines)


def test_the_triton_endpoint_applies_the_chat_template_too(served):
    text, _ = random_words(50, seed=18)
    ids = chat_input_ids(served.engine.tokenizer, [{"role": "user", "content": text}])
    url = f"http://127.0.0.1:{served.ports['--http-port']}/v2/models/{MODEL}/generate"
    body = {"text_input": text, "max_tokens": 6, "apply_chat_template": True, "exclude_input_in_output": True}
    with urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode()), timeout=120) as response:
        assert json.loads(response.read())["text_output"] == served.expected(ids, 6)


def test_a_client_that_goes_away_frees_its_slot(served):
    """One slot (max_num_seqs 1): a short request waits behind a long stream, and runs once its client
    closes the stream."""
    long = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": random_words(40, 19)[0]}], max_tokens=LONG, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(long)
    for _ in range(4):
        next(chunks)
    text, ids = random_words(30, seed=20)
    box = {}

    def short_request():
        try:
            box["out"] = served.client.completions.create(model=MODEL, prompt=text, max_tokens=4)
        except openai.APIStatusError as err:
            box["out"] = err.response.text

    short = threading.Thread(target=short_request)
    short.start()
    short.join(3.0)
    assert short.is_alive(), "the short request ran while the long stream held the only slot"
    long.close()  # the client goes away
    short.join(60)
    assert not short.is_alive()
    assert not isinstance(box["out"], str), box["out"]
    assert box["out"].choices[0].text == served.expected(ids, 4)


def test_a_context_is_compressed_once_and_reused(served):
    # `context` (criticalkv's field): the document is compressed alone and cached; later questions about it skip its
    # prefill (context_cache_hit) and answer like the engine does from the same split of the chat
    from criticalkv.chat import chat_context_ids

    tokenizer = served.engine.tokenizer
    doc, _ = random_words(150, seed=21)
    hits, texts = [], []
    for seed in (22, 23):
        question, _ = random_words(6, seed=seed)
        messages = [{"role": "user", "content": question}]
        status, out = served.post("/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 7,
                                                        "context": doc})
        assert status == 200, out
        context_ids, question_ids = chat_context_ids(tokenizer, messages, doc)
        tokens = served.engine.generate([context_ids], 7, questions=[question_ids]).tokens[0]
        assert out["choices"][0]["message"]["content"] == tokenizer.decode(tokens, skip_special_tokens=True)
        assert out["usage"]["prompt_tokens"] == len(context_ids) + len(question_ids)
        hits.append(out["context_cache_hit"])
    assert hits == [False, True]
    # context: true = the conversation's earlier turns are the context (a follow-up turn reuses them)
    turns = [{"role": "user", "content": doc}, {"role": "assistant", "content": "w7 w8"},
             {"role": "user", "content": random_words(5, seed=24)[0]}]
    outs = [served.post("/chat/completions", {"model": MODEL, "messages": turns, "max_tokens": 5, "context": True})
            for _ in range(2)]
    assert [o[0] for o in outs] == [200, 200] and [o[1]["context_cache_hit"] for o in outs] == [False, True]
    context_ids, question_ids = chat_context_ids(tokenizer, turns, True)
    tokens = served.engine.generate([context_ids], 5, questions=[question_ids]).tokens[0]
    assert outs[1][1]["choices"][0]["message"]["content"] == tokenizer.decode(tokens, skip_special_tokens=True)
    # streaming carries the flag on its last chunk; a bad context is a 400
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=turns, max_tokens=5, stream=True,
                                                        extra_body={"context": True}))
    assert [c.model_extra.get("context_cache_hit") for c in chunks if c.choices and c.choices[0].finish_reason] == [True]
    status, out = served.post("/chat/completions", {"model": MODEL, "messages": turns[:2], "context": True})
    assert status == 400 and "the last message must be the user's" in out["error"]["message"]
    status, out = served.post("/completions", {"model": MODEL, "prompt": "w5", "context": True})
    assert status == 400 and "needs /v1/chat/completions" in out["error"]["message"]


def test_taken_ports_are_named_before_anything_starts(served, capsys, tmp_path):
    """A second serve on the ports of the running one: one line naming the port, status 2, no `ready:`."""
    from criticalkv.serving.launcher import free_port

    fresh = {flag: str(free_port()) for flag in served.ports}
    for taken in ("--http-port", "--grpc-port", "--openai-port"):
        ports = dict(fresh, **{taken: str(served.ports[taken])})
        argv = ["serve", "--engine-dir", str(served.engine_dir), *[a for kv in ports.items() for a in kv]]
        capsys.readouterr()
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert "ready:" not in out and err.strip() == (
            f"criticalkv serve: error: port {served.ports[taken]} ({taken}) on 127.0.0.1 is already in use "
            f"(another server?): stop it or choose another port with {taken}")


def test_a_server_that_cannot_take_its_ports_is_never_reported_ready(served, tmp_path, monkeypatch):
    """Past the check (a port taken between the check and the start): tritonserver fails to bind, and the
    answers of the server already on that port do not make it look ready."""
    from criticalkv.serving import launcher
    from criticalkv.serving.repository import make_repository

    repo = tmp_path / "repo"
    make_repository(served.engine_dir, repo, threads=1, execution_env=str(launcher.model_env()),
                    python_paths=launcher.project_paths())
    monkeypatch.setattr(launcher, "check_ports_free", lambda host, ports: None)
    server = launcher.TritonServer(repo, served.ports["--http-port"], launcher.free_port(), launcher.free_port(),
                                   log_file=tmp_path / "log")
    with pytest.raises(RuntimeError, match="exited with code 1 before it was ready"):
        server.start(timeout_s=240)
    assert "failed to start HTTP service" in server.log_tail()


def test_a_launcher_killed_with_its_watchdog_is_cleaned_up_by_the_next_start(served, capsys, monkeypatch):
    """SIGKILL of `criticalkv serve` and of its watchdog at once (tests/serving/test_shutdown.py kills the launcher
    alone): tritonserver ends by its parent-death signal; the next start (here one that stops at a taken port) kills
    whatever of the server is left, and removes the temporary repository and the shared-memory regions the killed
    launcher's server named after it. Runs last: it ends the module's server."""
    import tempfile

    from criticalkv.serving.launcher import SHM_PREFIX

    launcher_process = psutil.Process(served.process.pid)
    children = launcher_process.children(recursive=True)
    watchdogs = [p for p in children if "criticalkv/serving/watchdog.py" in " ".join(p.cmdline())]
    assert {p.name() for p in children} >= {"tritonserver", "triton_python_backend_stub"} and len(watchdogs) == 1
    leftovers = sorted(served.tmp.glob(f"criticalkv-serve-{served.process.pid}-*"))
    assert len(leftovers) == 1 and (leftovers[0] / "models" / MODEL / "config.pbtxt").is_file()
    regions = [p for p in Path("/dev/shm").glob(f"{SHM_PREFIX}{served.process.pid}_*")]
    assert regions
    watchdogs[0].kill()
    served.process.kill()
    served.process.wait(10)
    gone, alive = psutil.wait_procs([p for p in children if p.name() == "tritonserver"], timeout=10)
    assert not alive, f"tritonserver still running 10 s after the launcher's SIGKILL: {alive}"
    # the next start removes the killed launcher's repository, its shared memory and any process of its server
    monkeypatch.setattr(tempfile, "tempdir", str(served.tmp))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        capsys.readouterr()
        assert main(["serve", "--engine-dir", str(served.engine_dir), "--http-port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert f"removed {leftovers[0]}: a temporary left by process {served.process.pid}" in err
    assert not leftovers[0].exists()
    assert not [r for r in regions if r.exists()], err
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"still running after the next start: {alive}"
