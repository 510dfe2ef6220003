import pytest

from tests.shared_data import gpt2_skip_reason
from tests.unit.tokenizer.strings import MERGES, VOCAB


@pytest.fixture(scope="session")
def gpt2_files():
    """GPT-2's vocab and merges (tests taking it are marked ``shared_data``: tests/conftest.py)."""
    reason = gpt2_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return VOCAB, MERGES
