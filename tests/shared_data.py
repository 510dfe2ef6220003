"""Where the tests find the data they do not ship: the one place that says so.

``../shared`` beside the checkout holds ``data/gpt2/`` (GPT-2's vocabulary and merges),
``data/wikitext-2/`` (WikiText-2's validation and test text) and ``peers/nanogpt/model.py``.
``MEGATRON_TEST_DATA`` names another ``data`` folder (a copy carried to another machine; its
``peers`` is then the folder beside it), or a missing folder, which hides all of it: a fresh
clone. ``NANOGPT_MODEL`` names nanoGPT's model.py directly (as the benchmarks read it).

Tests whose outcome depends on these files carry the ``shared_data`` marker (``tests/conftest.py``
adds it to every test that takes the ``gpt2_files`` fixture); CI runs them a second time with
``MEGATRON_TEST_DATA`` at a missing folder (``.ci/run``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# The data folder: $MEGATRON_TEST_DATA, else ../shared/data beside the checkout.
SHARED = Path(os.environ.get("MEGATRON_TEST_DATA")
              or Path(__file__).resolve().parents[1].parent / "shared" / "data")
VOCAB = SHARED / "gpt2" / "gpt2-vocab.json"
MERGES = SHARED / "gpt2" / "gpt2-merges.txt"
WIKITEXT = SHARED / "wikitext-2"
WIKITEXT_VALID = WIKITEXT / "valid.txt"
# The folder that holds data/ and peers/ (what benchmarks/gpu_check.py --prepare copies from).
ROOT = SHARED.parent
ENV = "MEGATRON_TEST_DATA"


def have_gpt2_files() -> bool:
    return VOCAB.is_file() and MERGES.is_file()


def have_wikitext() -> bool:
    return WIKITEXT_VALID.is_file()


def nanogpt_model() -> Optional[Path]:
    """nanoGPT's model.py: $NANOGPT_MODEL, else peers/nanogpt/model.py beside the data
    folder; None where neither is a file."""
    for candidate in (os.environ.get("NANOGPT_MODEL"), ROOT / "peers" / "nanogpt" / "model.py"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def missing(*paths: Path, also: str = "") -> str:
    """A skip reason naming the files that are not there and how to provide them."""
    absent = [str(p) for p in paths if not Path(p).is_file()]
    return (f"needs {', '.join(absent)} (not found; put ../shared beside the checkout or set "
            f"{ENV} to a copy of its data folder{also})")


def gpt2_skip_reason() -> Optional[str]:
    """None when GPT-2's vocab and merges are here, else what a skip should say."""
    return None if have_gpt2_files() else missing(VOCAB, MERGES)
