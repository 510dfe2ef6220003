"""Undo the tokenization of WikiText and PTB text (``" @-@ "``, ``" , "``...) so the GPT
tokenizer sees ordinary text, as Megatron's zero-shot evaluation does. Which one applies is
read from the file name (``wiki``, ``ptb``, ``lambada``), as in Megatron."""

from __future__ import annotations

import re
from collections.abc import Callable


def ptb_detokenizer(text: str) -> str:
    for old, new in ((" '", "'"), (" \n", "\n"), ("\n ", "\n"), (" n't", "n't"),
                     (" N ", "1 "), ("$ 1", "$1"), ("# 1", "#1")):
        text = text.replace(old, new)
    return text


# (pattern, replacement) in order; plain strings are replaced as they are.
_WIKITEXT_STEPS: tuple[tuple[str, str], ...] = (
    ("s '", "s'"),  # plural possessive
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),  # number and hyphen separators
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
)
# Spaces just inside brackets and quotes: "( text )" -> "(text)".
_WIKITEXT_BRACKETS = tuple(re.compile(p) for p in (
    r"\(\s*([^\)]*?)\s*\)", r"\[\s*([^\]]*?)\s*\]", r"{\s*([^}]*?)\s*}",
    r"\"\s*([^\"]*?)\s*\"", r"'\s*([^']*?)\s*'"))
_BRACKET_FORMS = ("(\\1)", "[\\1]", "{\\1}", '"\\1"', "'\\1'")
_WIKITEXT_AFTER = (
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"),
    (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s"),
)


def wikitext_detokenizer(text: str) -> str:
    for old, new in _WIKITEXT_STEPS:
        text = text.replace(old, new)
    for pattern, form in zip(_WIKITEXT_BRACKETS, _BRACKET_FORMS):
        text = pattern.sub(form, text)
    for old, new in _WIKITEXT_AFTER:
        text = text.replace(old, new)
    return text


def identity_detokenizer(text: str) -> str:
    return text


_BY_NAME = {"ptb": ptb_detokenizer, "wiki": wikitext_detokenizer,
            "lambada": identity_detokenizer}


def detokenizer_for(path: str) -> tuple[str, Callable[[str], str]]:
    """(name, function) of the detokenizer for ``path`` (by the words in its name; none
    matching: the text is used as it is)."""
    for key, fn in _BY_NAME.items():
        if key in path:
            return key, fn
    return "none", identity_detokenizer
