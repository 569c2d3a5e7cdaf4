"""Slots on a real server (one instance, max_num_seqs = 2): a third request waits for a slot, and a client
that cancels mid-stream frees its slot at once."""

import json
import queue
import re
import threading
import time
import urllib.request

import numpy as np
import pytest

from serving.servers import MODEL, Served, random_words, start_server, stop_server

LONG = 20000  # tokens: a long generation occupies its slot for far longer than these tests wait


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server, engine = start_server(tmp_path_factory, instances=1, max_num_seqs=2, max_batch_size=2,
                                  max_new_tokens=LONG)
    yield Served(server, engine)
    stop_server(server, engine)


class LongStream:
    """A streaming gRPC request of LONG tokens; ``cancel()`` cancels it from the client side."""

    def __init__(self, served, seed):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(served.server.grpc_url)
        self.responses = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        text, _ = random_words(40, seed)
        inputs = []
        sampling = json.dumps({"max_tokens": LONG, "ignore_eos": True})  # the tiny model emits </s> early
        for name, dtype, value in [("text_input", "BYTES", np.array([text.encode()], dtype=object)),
                                   ("stream", "BOOL", np.array([True])),
                                   ("sampling_parameters", "BYTES", np.array([sampling.encode()], dtype=object))]:
            tensor = grpcclient.InferInput(name, [1], dtype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        self.client.async_stream_infer(MODEL, inputs, request_id=str(seed))

    def wait_tokens(self, count):
        for _ in range(count):
            result, error = self.responses.get(timeout=120)
            assert error is None, error

    def cancel(self):
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def waiting_requests(served):
    metrics = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    return int(float(re.search(r"criticalkv_requests_waiting\{[^}]*\} (\S+)", metrics).group(1)))


def short_request(served, seed, box):
    text, ids = random_words(30, seed)
    box["expected"] = served.expected_text(ids, 5)
    box["result"] = served.post("generate", {"text_input": text, "max_tokens": 5, "exclude_input_in_output": True})


def test_a_third_request_waits_for_a_slot_then_completes(served):
    a, b = LongStream(served, 1), LongStream(served, 2)
    a.wait_tokens(3)
    b.wait_tokens(3)
    box = {}
    third = threading.Thread(target=short_request, args=(served, 3, box))
    third.start()
    try:
        deadline = time.monotonic() + 60
        while waiting_requests(served) != 1:  # the scheduler queues it: both slots are taken
            assert time.monotonic() < deadline, "the third request never showed as waiting"
            time.sleep(0.2)
        third.join(2.0)
        assert third.is_alive(), "the third request completed while both slots were busy"
    finally:
        a.cancel()
        b.cancel()
    third.join(60)
    status, out = box["result"]
    assert status == 200 and out["text_output"] == box["expected"]


def test_cancel_mid_stream_frees_the_slot(served):
    a, b = LongStream(served, 4), LongStream(served, 5)
    a.wait_tokens(3)
    b.wait_tokens(3)
    a.cancel()  # b keeps its slot; a's slot must be freed for the next request
    try:
        box = {}
        short_request(served, 6, box)
        status, out = box["result"]
        assert status == 200 and out["text_output"] == box["expected"]
        b.wait_tokens(3)  # b is still streaming: the request took a's slot
    finally:
        b.cancel()
    box = {}
    short_request(served, 7, box)
    assert box["result"][0] == 200
