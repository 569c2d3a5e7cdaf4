#!/usr/bin/env python
"""Render a Triton model repository for an engine directory (`criticalkv serve --write-repo`: nothing started).

    python scripts/make_triton_repo.py --engine-dir engines/smollm2-criticalkv --out models [--model-name ...
        --instances N --max-num-seqs N --kv-memory-mib MIB --backend onnxruntime|tensorrt|torch --gpus 0,1]
"""

import sys

from criticalkv.cli import main

if __name__ == "__main__":
    argv = ["--write-repo" if a == "--out" else a.replace("--out=", "--write-repo=", 1) for a in sys.argv[1:]]
    sys.exit(main(["serve", *argv]))
