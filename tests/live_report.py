"""pytest plugin of the GPU check (``scripts/gpu_check.sh`` loads it with ``-p live_report``).

A GPU run may be stopped at its time limit, and pytest prints its failure tracebacks only at the end of the session.
This plugin prints each failure's report (``--tb`` style) the moment the test fails, and appends one JSON line per
test outcome to the file named by ``$CKV_LIVE_REPORT`` (a ``collected`` line first with every node id), so a run cut
short still says what failed, what passed and what was never reached. Under pytest-xdist the controller writes the
outcomes and the first worker the collected ids.
"""

from __future__ import annotations

import json
import os
import time

_config = None


def _worker() -> str | None:
    return os.environ.get("PYTEST_XDIST_WORKER")


def _append(record: dict) -> None:
    path = os.environ.get("CKV_LIVE_REPORT")
    if not path:
        return
    with open(path, "a") as f:  # one short write per line: lines of several processes do not interleave
        f.write(json.dumps(record) + "\n")


def pytest_configure(config):
    global _config
    _config = config


def pytest_collection_finish(session):
    if _worker() in (None, "gw0"):
        _append({"event": "collected", "nodeids": [item.nodeid for item in session.items], "time": time.time()})


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = getattr(report, "longreprtext", "") or ""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.lstrip().startswith("E ")]
    return (errors[0] if errors else lines[-1] if lines else "").strip()[:400]


def pytest_runtest_logreport(report):
    if _worker() is not None:  # the controller reports every outcome once
        return
    if report.when != "call" and report.passed:
        return
    _append({"event": "outcome", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
             "duration": round(report.duration, 3), "message": _message(report) if not report.passed else "",
             "time": time.time()})
    if report.failed and _config is not None:
        terminal = _config.pluginmanager.getplugin("terminalreporter")
        if terminal is not None:
            terminal.ensure_newline()
            terminal.write_sep("_", f"FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)", red=True)
            terminal.write_line(report.longreprtext)
            terminal.write_sep("_", "continuing")
