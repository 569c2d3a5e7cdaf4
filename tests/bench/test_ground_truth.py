"""The benchmark clients checked against ground truth: a stand-in model on the real tritonserver streams tokens on a
fixed schedule (first token 300 ms after the request arrives, then one every 50 ms: tests/bench/standin/), and
criticalkv's load generator, then AIPerf (only where its environment exists: `criticalkv bench setup-peers --only
aiperf` makes .peers/aiperf; else skipped), must measure TTFT, ITL / TPOT and request latency within 5 %.

A check that misses is measured once more (``ATTEMPTS``): a stall of another process on a shared machine (one run
in ~10 here saw a 0.5 s stall at load 5) must not fail CI, while an error of the client repeats itself in every
attempt. Medians of TTFT and latency are checked (one request's wake-up delayed by other work on a shared 2-core machine
moves a mean of a few requests by more than 5 %, seen at load 10); ITL and TPOT are checked as means too: the
schedule sets every token by its deadline from the arrival, so their mean over a request is immune to one late
token. Every value measured is printed.

Run the AIPerf one by hand with ``-s`` to see both tools' numbers.
"""

import os
from pathlib import Path

import pytest

from criticalkv.bench.client import Endpoint, request_body, run_load
from criticalkv.bench.metrics import summarize

STANDIN = Path(__file__).parent / "standin"
ROOT = Path(__file__).resolve().parents[2]
MODEL = "standin"
TTFT_MS, ITL_MS = 300.0, 50.0
OSL = 8
REQUESTS = 6
#: AIPerf's own processes take most of a core of a 2-core machine while it measures: more requests for a steadier median
AIPERF_REQUESTS = 10
TOLERANCE = 0.05
ATTEMPTS = 2
#: the text of every streamed token: one token of the test tokenizer (AIPerf re-tokenises the streamed text)
TOKEN_TEXT = " the"


def within(measured, truth, tol=TOLERANCE):
    return measured is not None and abs(measured / truth - 1.0) <= tol


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """A tritonserver serving the stand-in model; yields its URL."""
    from criticalkv.serving import launcher
    from criticalkv.serving.repository import render

    if not launcher.is_set_up():
        pytest.fail("tritonserver is not set up: run `criticalkv serve --setup` (scripts/install.sh does)")
    repo = tmp_path_factory.mktemp("standin-repo")
    (repo / MODEL / "1").mkdir(parents=True)
    env = f'parameters: {{ key: "EXECUTION_ENV_PATH", value: {{ string_value: "{launcher.model_env().resolve()}" }} }}'
    (repo / MODEL / "config.pbtxt").write_text(render((STANDIN / "config.pbtxt").read_text(), {
        "model_name": MODEL, "ttft_ms": TTFT_MS, "itl_ms": ITL_MS, "token_text": TOKEN_TEXT,
        "execution_env_parameter": env}))
    (repo / MODEL / "1" / "model.py").write_text((STANDIN / "model.py").read_text())
    server = launcher.TritonServer(repo, log_file=repo / "tritonserver.log")
    server.start(timeout_s=120)
    try:
        yield server.http_url
    finally:
        server.stop()


def expected():
    """What an exact client measures on the stand-in (ms)."""
    return {"ttft": TTFT_MS, "itl": ITL_MS, "tpot": ITL_MS, "latency": TTFT_MS + (OSL - 1) * ITL_MS}


def attempts(measure):
    """Call ``measure()`` -> (checked, shown) up to ``ATTEMPTS`` times, printing each; the values off by more than
    the tolerance in the last attempt (empty when one attempt was within it)."""
    for attempt in range(1, ATTEMPTS + 1):
        name, checked, shown = measure()
        print(f"\n{name} vs the stand-in's schedule (ms), attempt {attempt}: "
              + "; ".join(f"{k} {v:.2f} (truth {t:g})" for k, (v, t) in {**checked, **shown}.items()))
        bad = {k: v for k, v in checked.items() if not within(*v)}
        if not bad:
            return {}
    return bad


def test_this_client_measures_the_known_schedule(standin):
    endpoint = Endpoint(standin, MODEL)
    bodies = [request_body(f"prompt number {i}", OSL) for i in range(REQUESTS + 1)]
    run_load(endpoint, bodies[:1], concurrency=1)  # warm-up: the stub's first request

    def measure():
        records = run_load(endpoint, bodies[1:], concurrency=2)
        s = summarize(records)
        assert s["completed"] == REQUESTS and s["failed"] == 0
        assert s["output_tokens"]["min"] == s["output_tokens"]["max"] == OSL
        assert s["itl_ms"]["count"] == REQUESTS * (OSL - 1)
        # concurrency 2: two requests overlapped (the schedule does not depend on load: no model runs)
        assert s["peak_requests_in_flight"] == 2
        truth = expected()
        checked = {"ttft p50": (s["ttft_ms"]["p50"], truth["ttft"]), "itl avg": (s["itl_ms"]["avg"], truth["itl"]),
                   "itl p50": (s["itl_ms"]["p50"], truth["itl"]), "tpot avg": (s["tpot_ms"]["avg"], truth["tpot"]),
                   "tpot p50": (s["tpot_ms"]["p50"], truth["tpot"]),
                   "latency p50": (s["latency_ms"]["p50"], truth["latency"])}
        shown = {"ttft avg": (s["ttft_ms"]["avg"], truth["ttft"]), "ttft max": (s["ttft_ms"]["max"], truth["ttft"])}
        return f"this client ({REQUESTS} requests, concurrency 2)", checked, shown

    bad = attempts(measure)
    assert not bad, f"off by more than {TOLERANCE:.0%} in {ATTEMPTS} attempts: {bad}"


def _peers_dir() -> Path:
    return Path(os.environ.get("CRITICALKV_PEERS_DIR", ROOT / ".peers"))


def test_aiperf_measures_the_known_schedule(standin, tmp_path):
    from criticalkv.bench.aiperf import run_aiperf
    from criticalkv.bench.peers import peer_ready

    if not peer_ready(_peers_dir(), "aiperf"):
        pytest.skip(f"no AIPerf environment in {_peers_dir()} (criticalkv bench setup-peers --only aiperf)")
    from eval.conftest import tiny_tokenizer

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = tiny_tokenizer()
    assert len(tokenizer(TOKEN_TEXT * OSL, add_special_tokens=False)["input_ids"]) == OSL  # AIPerf counts OSL tokens
    tokenizer.save_pretrained(tokenizer_dir)

    class Prompt:
        def __init__(self, text):
            self.text = text

    prompts = [Prompt(f"prompt number {i}") for i in range(AIPERF_REQUESTS + 1)]

    def measure():
        workdir = tmp_path / f"aiperf-{len(list(tmp_path.glob('aiperf-*')))}"
        metrics, command, osl = run_aiperf(_peers_dir(), standin, MODEL, tokenizer_dir, prompts, OSL, concurrency=2,
                                           num_requests=AIPERF_REQUESTS, warmup=1, workdir=workdir)
        assert osl.get("avg") == OSL
        truth = expected()
        ttft, itl, latency = (metrics[k] for k in ("time_to_first_token", "inter_token_latency", "request_latency"))
        checked = {"ttft p50": (ttft["p50"], truth["ttft"]), "inter_token_latency avg": (itl["avg"], truth["tpot"]),
                   "inter_token_latency p50": (itl["p50"], truth["tpot"]),
                   "request_latency p50": (latency["p50"], truth["latency"])}
        shown = {"ttft avg": (ttft["avg"], truth["ttft"]), "ttft max": (ttft["max"], truth["ttft"])}
        return f"AIPerf ({AIPERF_REQUESTS} requests, concurrency 2)", checked, shown

    bad = attempts(measure)
    assert not bad, f"AIPerf off by more than {TOLERANCE:.0%} in {ATTEMPTS} attempts: {bad}"
