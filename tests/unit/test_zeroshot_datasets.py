"""The zero-shot datasets: every WikiText target scored exactly once whatever the stride, the
LAMBADA target positions, and errors that name the file, line or flag."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron.inference.evaluation.datasets import (
    EvaluationDataError,
    LambadaDataset,
    WindowedLMDataset,
)
from megatron.inference.evaluation.detokenizer import detokenizer_for, wikitext_detokenizer


class CharTokenizer:
    """One id per character (ord); eod 0."""

    eod = 0
    vocab_size = 256

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize("n,seq,stride", [(2, 8, 8), (9, 8, 8), (10, 8, 8), (50, 8, 3),
                                          (50, 8, 1), (7, 8, 5), (33, 16, 16)])
def test_every_target_is_scored_once(n, seq, stride):
    tokens = list(range(1, n + 1))
    data = WindowedLMDataset(tokens, seq, stride, pad_id=0, num_original_tokens=n)
    scored: list[int] = []
    for i in range(len(data)):
        item = data[i]
        assert item["text"].shape == (seq + 1,) and item["pad_mask"].shape == (seq,)
        targets = item["text"][1:]
        scored += targets[item["pad_mask"] == 1].tolist()
    assert scored == tokens[1:]  # each target once, in order
    assert data[len(data) - 1]["pad_mask"].sum() > 0  # no window scores nothing


def test_later_windows_see_context_before_their_targets():
    data = WindowedLMDataset(list(range(1, 41)), 8, 2, pad_id=0, num_original_tokens=40)
    mask = data[3]["pad_mask"]
    assert mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]  # 6 tokens of context, 2 scored


def test_stride_outside_one_to_seq_length_is_refused():
    with pytest.raises(EvaluationDataError, match="--overlapping-eval 9 must be between 1 and "
                       r"--seq-length \(8\)"):
        WindowedLMDataset([1, 2, 3], 8, 9, 0, 3)


def _lambada(tmp_path, lines, strict=False, seq=32):
    path = tmp_path / "lambada.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return LambadaDataset(str(path), CharTokenizer(), seq, strict)


def test_lambada_scores_the_last_token_or_the_last_word(tmp_path):
    line = json.dumps({"text": "a bc def"})
    item = _lambada(tmp_path, [line])[0]
    assert np.flatnonzero(item["pad_mask"]).tolist() == [6]  # predicts "f" after "a bc de"
    strict = _lambada(tmp_path, [line], strict=True)[0]
    # context "a bc" (4 ids), target " def" (4 ids): positions 3..6 predict them
    assert np.flatnonzero(strict["pad_mask"]).tolist() == [3, 4, 5, 6]
    assert strict["text"][:8].tolist() == [ord(c) for c in "a bc def"]


@pytest.mark.parametrize("line,message", [
    ("{not json", "line 2: not JSON"),
    ('{"txt": "a b"}', 'line 2: expected {"text": "..."}'),
    ('{"text": "x"}', "line 2: too short"),
    (json.dumps({"text": "word " * 20}), r"line 2: 100 tokens, more than --seq-length \+ 1"),
])
def test_bad_lambada_lines_are_named(tmp_path, line, message):
    with pytest.raises(EvaluationDataError, match=message):
        _lambada(tmp_path, [json.dumps({"text": "fine text"}), line])


def test_detokenizer_follows_the_file_name():
    assert detokenizer_for("data/wikitext-103/wiki.test.tokens")[0] == "wiki"
    assert detokenizer_for("ptb.test.txt")[0] == "ptb"
    assert detokenizer_for("my.txt")[0] == "none"
    text = " = Title = \n 1 @,@ 000 km @-@ long ( see here ) ."
    assert wikitext_detokenizer(text) == " = Title =\n1,000 km-long (see here) ."
