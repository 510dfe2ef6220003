import os

import pytest
import torch

# Tests must not fight over the two cores; each spawned rank sets its own thread count too.
torch.set_num_threads(int(os.environ.get("TEST_NUM_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
