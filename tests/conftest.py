import glob
import os

import pytest
import torch

from tests.corpus import build_corpus

# Tests must not fight over the two cores; each spawned rank sets its own thread count too.
torch.set_num_threads(int(os.environ.get("TEST_NUM_THREADS", "2")))


# Before pytest's own hook deselects by marker (-m shared_data): the marker must be there.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        # GPT-2's files, by the fixture that hands them out (tests/unit/tokenizer/conftest.py).
        if "gpt2_files" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.shared_data)
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


# DeepSpeed's CPU all-reduce maps a shared-memory buffer per rank (66 MB each under /dev/shm)
# and never removes it; over a whole suite they would hold gigabytes of the machine's memory.
_DEEPSPEED_SHM = "/dev/shm/deepspeed_allreduce_buffer_*"


def _mapped_shared_memory() -> set[str]:
    """The /dev/shm files some live process has mapped."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                              for line in f if "/dev/shm/" in line)
        except (OSError, IndexError):
            pass  # the process ended while we read
    return mapped


@pytest.fixture(scope="module", autouse=True)
def _remove_deepspeeds_shared_memory():
    """Remove the buffers a test module's DeepSpeed ranks left (those that were there before
    the module, and those a live process still maps, such as another pytest worker's ranks,
    are left alone)."""
    before = set(glob.glob(_DEEPSPEED_SHM))
    yield
    left = set(glob.glob(_DEEPSPEED_SHM)) - before
    if not left:
        return
    for path in left - _mapped_shared_memory():
        try:
            os.remove(path)
        except OSError:
            pass
