import os

import pytest
import torch

from tests.corpus import build_corpus

# Tests must not fight over the two cores; each spawned rank sets its own thread count too.
torch.set_num_threads(int(os.environ.get("TEST_NUM_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The real-text corpus of tests/corpus.py, built once per test module (modules that need
    another corpus define their own ``corpus``)."""
    return build_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A folder for the GPT dataset index caches of one test module."""
    return str(tmp_path_factory.mktemp("cache"))
