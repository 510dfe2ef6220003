"""Tokenizer errors; messages name the flag or file at fault."""


class TokenizerConfigError(ValueError):
    """A tokenizer flag is missing or wrong; the message names the flag."""


class TokenizerFileError(TokenizerConfigError):
    """A vocab or merges file is missing or not in the expected format."""


class LoneSurrogateError(ValueError):
    """The text has a lone surrogate (from a JSON escape) and so no UTF-8 bytes to encode."""
