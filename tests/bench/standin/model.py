"""A stand-in Triton model with a known schedule: the ground truth a benchmark client is checked against.

Decoupled Python backend, criticalkv's request and response names (``text_input``, ``sampling_parameters`` with
``max_tokens``, ``stream``; ``text_output``, ``num_output_tokens``, ``finish_reason``). Each request is served on its
own thread: its k-th token (k = 0, 1, ...) is sent at ``arrival + ttft_ms + k * itl_ms`` (deadlines from the arrival,
not sleeps in a row, so a late wake-up does not shift the tokens after it), each response carrying one token whose
text is ``token_text``. No model runs: the only time spent is the schedule's, so a client measures TTFT = ttft_ms
and every inter-token gap = itl_ms, plus the HTTP path's own (sub-millisecond) latency.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.ttft_s = float(params["ttft_ms"]["string_value"]) / 1e3
        self.itl_s = float(params["itl_ms"]["string_value"]) / 1e3
        self.token_text = params["token_text"]["string_value"]

    def execute(self, requests):
        for request in requests:
            arrived = time.perf_counter()
            sender = request.get_response_sender()
            try:
                max_tokens, prompt_words = self._parse(request)
            except Exception as err:  # a bad request: its error alone
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            # the Triton request stays referenced by the thread until its final response
            threading.Thread(target=self._stream, args=(request, sender, arrived, max_tokens, prompt_words),
                             daemon=True).start()
        return None

    def _parse(self, request):
        text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
        sampling = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        params = {} if sampling is None else json.loads(sampling.as_numpy().reshape(-1)[0])
        max_tokens = int(params.get("max_tokens", 16))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        return max_tokens, len(text.split())

    def _stream(self, request, sender, arrived, max_tokens, prompt_words):
        for k in range(max_tokens):
            delay = arrived + self.ttft_s + k * self.itl_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            final = k == max_tokens - 1
            tensors = [pb_utils.Tensor("text_output", np.array([self.token_text.encode()], dtype=np.object_)),
                       pb_utils.Tensor("num_output_tokens", np.array([1], np.uint32))]
            if final:
                tensors += [pb_utils.Tensor("finish_reason", np.array([b"length"], dtype=np.object_)),
                            pb_utils.Tensor("num_input_tokens", np.array([prompt_words], np.uint32))]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        del request
