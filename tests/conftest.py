import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the shared tables (policies.py) and oracles

# The served tests compare a server's answers with the tokens of the engine loaded here on ONNX Runtime (Engine.load's
# default), so every `criticalkv serve` they start (the servers inherit this) runs ONNX Runtime unless it names another
# --backend. serve's own default (OpenVINO where the CPU computes bf16: runtime.registry.served_backend) is tested
# where it is chosen (tests/test_cli.py, tests/runtime/test_registry.py) and where OpenVINO serves
# (tests/serving/test_openvino_serving.py).
os.environ.setdefault("CRITICALKV_SERVE_BACKEND", "onnxruntime")


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA works; they are skipped (not failed) elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)



@pytest.fixture(scope="module")
def one_thread():
    """One torch thread and one ONNX Runtime thread for a module's tests (CI's two shared cores gain nothing from more
    on the models the tests run), restored after."""
    from criticalkv.runtime.onnxruntime_backend import THREADS_ENV

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    os.environ[THREADS_ENV] = "1"
    yield
    torch.set_num_threads(previous)
    os.environ.pop(THREADS_ENV, None)


@pytest.fixture(scope="session")
def docs(tmp_path_factory):
    """The shell blocks of README.md and docs/ run once per session (tests/docs_blocks.py): tests/test_docs.py runs
    each, and other tests read what a block printed (``docs.run(docs.block("README.md", "build_engine.py"))``)."""
    from docs_blocks import DocsRunner

    runner = DocsRunner(tmp_path_factory.mktemp("docs"))
    yield runner
    runner.close()
