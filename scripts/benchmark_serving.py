#!/usr/bin/env python3
"""Serving benchmark: ``criticalkv bench serve`` (see ``--help``); the other modes by name.

    python scripts/benchmark_serving.py --engine-dir engines/smollm2-criticalkv --isl 2048 --osl 64 --concurrency 1,2,4,8
    python scripts/benchmark_serving.py --setup-peers            # kvpress, transformers, aiperf venvs in .peers/
    python scripts/benchmark_serving.py single --engine-dir engines/smollm2-criticalkv   # vs kvpress, transformers
    python scripts/benchmark_serving.py aiperf --engine-dir engines/smollm2-criticalkv   # AIPerf cross-check
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from criticalkv.cli import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--setup-peers"]:  # create the peers' environments (kvpress, transformers, aiperf)
        sys.exit(main(["bench", "setup-peers", *args[1:]]))
    if args[:1] and args[0] in ("single", "aiperf", "report", "setup-peers"):
        sys.exit(main(["bench", *args]))
    sys.exit(main(["bench", "serve", *args]))
