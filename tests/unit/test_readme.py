"""README claims that code can check."""

from __future__ import annotations

import re
from pathlib import Path

from megatron.config import ModelConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def _paragraph_with(text: str) -> str:
    for paragraph in README.read_text(encoding="utf-8").split("\n\n"):
        if text in " ".join(paragraph.split()):
            return " ".join(paragraph.split())
    raise AssertionError(f"README has no paragraph with {text!r}")


def test_layout_equivalence_claim_names_the_vocabulary_padding():
    claim = _paragraph_with("within 1e-5 (fp32)")
    assert "equal vocabulary padding" in claim
    assert "--make-vocab-size-divisible-by" in claim
    padded = {tp: ModelConfig(vocab_size=50257, tensor_model_parallel_size=tp).padded_vocab_size
              for tp in (1, 2)}
    assert padded == {1: 50304, 2: 50432}
    assert re.search(r"50304 at tensor parallel 1 but to 50432 at tensor parallel 2", claim)
    # The README's recipe for comparing tp 1 with tp 2 does pad both alike.
    assert "`--make-vocab-size-divisible-by 256` at tp 1 against the default at tp 2" in claim
    assert ModelConfig(vocab_size=50257, make_vocab_size_divisible_by=256).padded_vocab_size \
        == padded[2]
