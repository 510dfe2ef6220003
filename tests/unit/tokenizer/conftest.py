import os

import pytest

from tests.unit.tokenizer.strings import MERGES, VOCAB


@pytest.fixture(scope="session")
def gpt2_files():
    if not (os.path.isfile(VOCAB) and os.path.isfile(MERGES)):
        pytest.skip("shared GPT-2 vocab/merges files are not available")
    return VOCAB, MERGES
