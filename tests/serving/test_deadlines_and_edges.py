"""The pieces behind `criticalkv serve`'s guarantees, without a server: a request's deadline (``_within``), the HTTP
body's edges (``BodyLimitMiddleware`` under a real uvicorn), the ready banner's API key, the watchdog's processes,
and where a local Ray for the replicas listens (``ray_environment``, ``node_address``)."""

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from criticalkv.serving.openai_api import TIMED_OUT, APIError, BodyLimitMiddleware, _within


async def _slow(delays):
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield i


def _collect(responses):
    async def run():
        return [item async for item in responses]

    return asyncio.run(run())


def test_a_deadline_cancels_the_work_and_answers_504():
    closed = []

    async def work():
        try:
            async for item in _slow([0.01, 0.01, 5.0]):
                yield item
        finally:
            closed.append(True)  # the work was told to stop (its finally: the model request is cancelled)

    started = time.monotonic()
    with pytest.raises(APIError) as timed_out:
        _collect(_within(work(), 0.3, renew=False))
    assert 0.25 < time.monotonic() - started < 2.0 and closed == [True]
    assert timed_out.value.status == 504 and timed_out.value.type == "timeout"
    assert timed_out.value.message.startswith(f"{TIMED_OUT} (0.3 s for the whole answer")
    # a stream's deadline runs from its last item: slow in all, never silent for long
    assert _collect(_within(_slow([0.2] * 4), 0.3, renew=True)) == [0, 1, 2, 3]
    with pytest.raises(APIError, match="between two tokens"):
        _collect(_within(_slow([0.2, 0.6]), 0.3, renew=True))
    assert _collect(_within(_slow([0.01] * 3), None, renew=False)) == [0, 1, 2]


@pytest.fixture(scope="module")
def small_limit_server():
    """A real uvicorn serving an app that reads the whole body, behind BodyLimitMiddleware(1000 bytes, idle 1 s)."""
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        try:
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        except APIError as err:  # what create_app's handler does
            status, payload = err.status, json.dumps(err.body()).encode()
        else:
            status, payload = 200, json.dumps({"bytes": len(body)}).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(BodyLimitMiddleware(app, 1000, idle_s=1.0), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _post(port, body: bytes, headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    started = time.monotonic()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    out = json.loads(response.read())
    connection.close()
    return response.status, out, time.monotonic() - started, response.getheader("connection")


def test_a_large_body_written_whole_gets_a_413_the_client_reads(small_limit_server):
    status, out, seconds, _ = _post(small_limit_server, b"x" * 20_000_000)
    assert status == 413 and out["error"]["message"].startswith("the request body is 20000000 bytes"), out
    assert seconds < 5
    status, out, _, _ = _post(small_limit_server, b'{"prompt": "w5"}')  # the connection and the server go on
    assert status == 200 and out == {"bytes": 16}


def test_a_body_that_stops_arriving_gets_a_400_naming_what_came(small_limit_server):
    with socket.create_connection(("127.0.0.1", small_limit_server), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        response = http.client.HTTPResponse(sock)
        response.begin()
        out = json.loads(response.read())
        seconds = time.monotonic() - started
    assert response.status == 400 and out["error"]["message"] == (
        "the request body stopped arriving: 11 bytes of its Content-Length 100 came, then nothing for 1 s"), out
    assert 0.9 < seconds < 5


def test_the_ready_banner_names_the_key_as_it_was_given(monkeypatch):
    import argparse

    from criticalkv.commands.serve import resolve_api_key
    from criticalkv.serving.launcher import auth_header

    monkeypatch.setenv("CRITICALKV_API_KEY", "from-env")
    args = argparse.Namespace(api_key="from-flag")
    resolve_api_key(args)
    assert (args.api_key, args.api_key_source) == ("from-flag", "--api-key")
    assert auth_header(args.api_key, args.api_key_source) == " -H 'Authorization: Bearer <the --api-key value>'"
    args = argparse.Namespace(api_key=None)
    resolve_api_key(args)
    assert (args.api_key, args.api_key_source) == ("from-env", "$CRITICALKV_API_KEY")
    assert auth_header(args.api_key, args.api_key_source) == ' -H "Authorization: Bearer $CRITICALKV_API_KEY"'
    monkeypatch.delenv("CRITICALKV_API_KEY")
    args = argparse.Namespace(api_key=None)
    resolve_api_key(args)
    assert args.api_key is None and auth_header(None, None) == ""
    with pytest.raises(ValueError, match="--api-key is empty"):
        resolve_api_key(argparse.Namespace(api_key=" "))


def test_the_watchdog_kills_the_processes_it_was_given_when_its_owner_dies():
    """The owner here is this test (its pipe closed without "done"): the registered process is killed, one given with
    another start time (a reused number) is not."""
    from criticalkv.serving.watchdog import Watchdog, start_time

    watchdog = Watchdog("test")
    registered = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert watchdog.kill_process(registered.pid)
        watchdog._send(f"pid {other.pid} {int(start_time(other.pid)) + 1}")  # not the process that runs now
        assert not watchdog.kill_process(2**22 + 12345)  # no such process: nothing sent
        os.close(watchdog._write)  # as when this process dies
        watchdog._write = None
        assert watchdog.process.wait(15) == 0
        assert registered.wait(5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (registered, other):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_local_ray_for_a_loopback_host_is_told_it_may_take_loopback(monkeypatch):
    from criticalkv.replicas.launch import AUTH_MODE, LOOPBACK_SWITCH, node_address, ray_environment

    monkeypatch.setenv(AUTH_MODE, "token")  # a mode already named: only the loopback switch is set
    assert ray_environment("127.0.0.1", local=True) == {LOOPBACK_SWITCH: "0"}
    assert ray_environment("localhost", local=True) == {LOOPBACK_SWITCH: "0"}
    assert ray_environment("::1", local=True) == {LOOPBACK_SWITCH: "0"}
    assert ray_environment("127.0.0.1", local=False) == {}  # a cluster's own settings are left alone
    assert ray_environment("0.0.0.0", local=True) == {}
    assert node_address("127.0.0.1") == node_address("localhost") == "127.0.0.1"
    assert node_address("0.0.0.0") is None and node_address("10.1.2.3") == "10.1.2.3"


def test_a_local_ray_is_told_its_authentication_mode_unless_the_environment_names_one(monkeypatch):
    """Named, a new local Ray takes token authentication without warning "Token authentication is enabled" at every
    start (unnamed it takes the same mode and warns); a mode the user set is kept, a cluster joined keeps its own."""
    from criticalkv.replicas.launch import AUTH_MODE, LOOPBACK_SWITCH, ray_environment

    monkeypatch.delenv(AUTH_MODE, raising=False)
    assert ray_environment("127.0.0.1", local=True) == {LOOPBACK_SWITCH: "0", AUTH_MODE: "token"}
    assert ray_environment("0.0.0.0", local=True) == {AUTH_MODE: "token"}
    assert ray_environment("127.0.0.1", local=False) == {}
    monkeypatch.setenv(AUTH_MODE, "disabled")
    assert ray_environment("127.0.0.1", local=True) == {LOOPBACK_SWITCH: "0"}


def test_prepack_is_a_replica_option_off_by_default():
    """--replica-options prepack=1: the replicas' ONNX Runtime sessions prepack as `criticalkv serve` does; off by
    default; anything but 0 or 1 is one argparse line naming it."""
    import argparse

    from criticalkv.commands.serve_replicas import REPLICA_OPTIONS, replica_options

    assert REPLICA_OPTIONS["prepack"][1] is False
    assert replica_options("prepack=1,router=pow2") == {"prepack": True, "router": "pow2"}
    assert replica_options("prepack=0") == {"prepack": False}
    with pytest.raises(argparse.ArgumentTypeError, match="prepack='yes' is not a valid 0 or 1"):
        replica_options("prepack=yes")


def test_a_request_cancelled_while_it_waits_leaves_no_unretrieved_exception():
    """A response stream whose pending step ends with an error of its own when cancelled (as Ray Serve's handle does,
    RequestCancelledError): cancelling the request leaves nothing for asyncio to report as "never retrieved"."""
    import gc

    from criticalkv.serving.openai_api import _until

    class Stream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                raise RuntimeError("the request was cancelled") from None

    async def run():
        reported = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))

        async def consume():
            async for _ in _until(Stream(), asyncio.Event()):
                pass

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        for _ in range(3):
            await asyncio.sleep(0.02)
            gc.collect()
        return reported

    assert asyncio.run(run()) == []
