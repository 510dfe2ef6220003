"""Shared test inputs: the GPT-2 files (tests/shared_data.py says where they are), and strings that stress a BPE tokenizer."""

from tests.shared_data import MERGES as _MERGES
from tests.shared_data import VOCAB as _VOCAB
from tests.shared_data import WIKITEXT_VALID

# As strings: the tests pass them on as command-line arguments.
VOCAB, MERGES, WIKITEXT = str(_VOCAB), str(_MERGES), str(WIKITEXT_VALID)


def wikitext_paragraphs(count: int) -> list[str]:
    """WikiText-2's first ``count`` paragraphs (its blank lines are " \\n"); none without it."""
    if not WIKITEXT_VALID.is_file():
        return []
    with open(WIKITEXT_VALID, encoding="utf-8") as f:
        text = f.read(200_000)
    return [p for p in text.split(" \n \n") if p.strip()][:count]


# Unicode, whitespace runs, contractions, digits, emoji, control characters and the EOD text.
VARIED_STRINGS = [
    "Hello world",
    " Hello",
    "  two  spaces   three\n\n\nnewlines\t\ttabs ",
    "I'm you're we've they'll she'd it's DON'T ''''' 's",
    "12345 3.14159 1,000,000 \u0661\u0662\u0663 \u00bd 2024-01-01",
    "emoji \U0001f600\U0001f44d\U0001f3fd \U0001f1fa\U0001f1f8 family \U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "control \x00\x01\x07\x1b[0m \x7f \x85",
    "<|endoftext|>",
    "a<|endoftext|>b <|endoftext|>\n<|endoftext|>",
    "na\u00efve caf\u00e9 r\u00e9sum\u00e9 e\u0301",
    "\u00a0nbsp\u2028line-sep\u3000ideographic\ufeffbom",
    "",
    " ",
    "\n",
    "  \n ",
    "\r\n\r\nwindows line ends\r\n",
    "x" * 3000 + " end",
    "\u0120 byte-level look-alikes \u0100 \u0109",
    "code: def f(x):\n    return x ** 2  # comment",
]
