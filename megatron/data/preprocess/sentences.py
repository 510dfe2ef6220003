"""Sentence splitting with nltk Punkt (--split-sentences)."""

from __future__ import annotations

import json

from megatron.data.preprocess.config import PreprocessConfig
from megatron.data.preprocess.reading import Span, iter_chunks

PUNKT_SAMPLE_CHARS = 1_000_000  # text used to train Punkt when nltk's data is not installed


def _keep_newlines_lang_vars():
    from nltk.tokenize import punkt

    class KeepNewlinesLanguageVars(punkt.PunktLanguageVars):
        # Punkt normally requires whitespace before the next sentence and drops it; allowing
        # none (\s* inside the match) leaves newlines attached to the sentence they end.
        _period_context_fmt = r"""
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # whitespace kept with the sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next token
            ))"""

    return KeepNewlinesLanguageVars()


def build_splitter(config: PreprocessConfig, log=print):
    """A Punkt sentence splitter: nltk's data for --lang if installed, else trained here.

    Trained once, in the main process, on the first ~1M characters of the input, so every
    worker and partition splits with the same model.
    """
    from nltk.tokenize import punkt

    params = _installed_punkt_params(config.lang)
    if params is None:
        sample = _punkt_training_sample(config)
        trainer = punkt.PunktTrainer()
        trainer.train(sample, finalize=True)
        params = trainer.get_params()
        log(f"nltk punkt data for {config.lang!r} is not installed: trained a Punkt model on "
            f"the first {len(sample):,} characters of the input instead")
    lang_vars = _keep_newlines_lang_vars() if config.keep_newlines else punkt.PunktLanguageVars()
    return punkt.PunktSentenceTokenizer(params, lang_vars=lang_vars)


def _installed_punkt_params(lang: str):
    from nltk.tokenize import punkt

    try:
        return punkt.PunktTokenizer(lang)._params
    except (LookupError, OSError, AttributeError, ValueError):
        pass
    try:
        import nltk

        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")._params
    except (LookupError, OSError, ValueError):
        return None


def _punkt_training_sample(config: PreprocessConfig) -> str:
    texts: list[str] = []
    size = 0
    for chunk in iter_chunks([Span(p) for p in config.inputs], 1024):
        for line in chunk.lines:
            try:
                data = json.loads(line)
            except ValueError:
                continue
            for key in config.json_keys:
                value = data.get(key) if isinstance(data, dict) else None
                values = value if isinstance(value, list) else [value]
                for text in values:
                    if isinstance(text, str):
                        texts.append(text)
                        size += len(text)
            if size >= PUNKT_SAMPLE_CHARS:
                return "\n\n".join(texts)[:PUNKT_SAMPLE_CHARS]
    return "\n\n".join(texts)
