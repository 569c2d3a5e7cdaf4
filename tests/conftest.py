import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the shared tables (policies.py) and oracles


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA works; they are skipped (not failed) elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

