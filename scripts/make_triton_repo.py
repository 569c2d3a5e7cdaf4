#!/usr/bin/env python
"""Render a Triton model repository for an engine directory (same as `criticalkv triton-repo`).

    python scripts/make_triton_repo.py --engine-dir engines/smollm2-criticalkv --out models [--model-name ...
        --instances N --max-num-seqs N --kv-pool-mib MIB --backend onnxruntime|tensorrt --gpus 0,1]
"""

import sys

from criticalkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["triton-repo", *sys.argv[1:]]))
