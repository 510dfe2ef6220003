"""Requests to the REST server (Megatron's ``PUT /api``): checked, with a reason for each
refusal, before any rank starts generating.

Accepted JSON fields, as Megatron's text generation server reads them: ``prompts`` (list of
strings, required), ``tokens_to_generate`` (default 64, or the server's limit if lower;
0 scores the prompts and needs ``logprobs``), ``temperature`` (1.0), ``top_k`` (0),
``top_p`` (0.0; with ``top_k``, applied after it, where Megatron refuses both), ``logprobs`` (false), ``add_BOS`` (false), ``stop_on_eol``,
``stop_on_double_eol`` (false), ``random_seed`` (-1: drawn by the server), ``no_log``; and ours:
``stop`` (a list of stop strings). Megatron's fields for features this server does not have
(beam search, top-p decay, the newline rule) are accepted at their neutral values only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from megatron.inference.text_generation.sampling import SamplingParams

MAX_PROMPTS = 128  # Megatron's limit per request
MAX_STOP_STRINGS = 16

_NEUTRAL = {"top_p_decay": 0.0, "top_p_bound": 0.0, "prevent_newline_after_colon": False,
            "length_penalty": 1, "beam_width": None}
_KNOWN = {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "logprobs",
          "add_BOS", "stop_on_eol", "stop_on_double_eol", "random_seed", "no_log", "stop",
          *_NEUTRAL}


class RequestError(ValueError):
    """The request cannot be served; the message is the reason returned with HTTP 400."""


@dataclass(frozen=True)
class GenerationRequest:
    prompts: list[str]
    tokens_to_generate: int
    params: SamplingParams
    seed: int
    logprobs: bool
    add_bos: bool
    stop_strings: tuple[str, ...]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise RequestError(reason)


def decode_body(raw: bytes) -> dict:
    """The request's JSON object."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the parser recurses once per nested array or object
        raise RequestError("the request body is nested too deeply to read (a request is a "
                           "JSON object of strings, numbers and lists)") from None
    _require(isinstance(body, dict), "the request body must be a JSON object, not "
             f"{type(body).__name__}")
    return body


def _prompts(body: dict, max_prompts: int) -> list[str]:
    _require("prompts" in body, "prompts argument required")
    prompts = body["prompts"]
    _require(isinstance(prompts, list) and all(isinstance(p, str) for p in prompts),
             "prompts is not a list of strings")
    _require(len(prompts) > 0, "prompts is empty")
    _require(len(prompts) <= max_prompts, f"Maximum number of prompts is {max_prompts}")
    return prompts


def _sampling(body: dict) -> SamplingParams:
    temperature = body.get("temperature", 1.0)
    _require(_is_number(temperature) and 0.0 < temperature <= 100.0,
             "temperature must be a positive number less than or equal to 100.0")
    top_k = body.get("top_k", 0)
    _require(_is_int(top_k) and 0 <= top_k <= 1000,
             "top_k must be an integer between 0 and 1000")
    top_p = body.get("top_p", 0.0)
    _require(_is_number(top_p) and 0.0 <= top_p <= 1.0,
             "top_p must be a number between 0 and 1")
    return SamplingParams(float(temperature), top_k, float(top_p))


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    _require(isinstance(value, bool), f"{name} must be a boolean value")
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stops = body.get("stop", [])
    _require(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
             and len(stops) <= MAX_STOP_STRINGS,
             f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings")
    if _flag(body, "stop_on_double_eol"):
        stops = stops + ["\n\n"]
    if _flag(body, "stop_on_eol"):
        stops = stops + ["\n"]
    return tuple(stops)


def parse_request(body: dict, *, max_prompts: int = MAX_PROMPTS,
                  max_tokens_to_generate: int = 1024) -> GenerationRequest:
    """Check every field of ``body``; raise RequestError with the reason for the first that
    is wrong. The prompts themselves are checked by ``check_prompts_fit``."""
    unknown = sorted(set(body) - _KNOWN)
    _require(not unknown, f"unknown field(s): {', '.join(unknown)}")
    for name, neutral in _NEUTRAL.items():
        _require(body.get(name, neutral) == neutral,
                 f"{name} is not supported by this server (only {json.dumps(neutral)})")
    prompts = _prompts(body, max_prompts)
    tokens = body.get("tokens_to_generate", min(64, max_tokens_to_generate))
    _require(_is_int(tokens) and 0 <= tokens <= max_tokens_to_generate,
             f"tokens_to_generate must be an integer between 0 and {max_tokens_to_generate}")
    logprobs = _flag(body, "logprobs")
    _require(tokens > 0 or logprobs, "tokens_to_generate=0 implies logprobs should be True")
    seed = body.get("random_seed", -1)
    _require(_is_int(seed) and -1 <= seed < 2**64, "random_seed must be an integer from 0 "
             "to 2^64-1 (a 64-bit generator seed), or -1: any")
    if seed == -1:
        seed = random.randrange(2**31)
    _flag(body, "no_log")
    return GenerationRequest(prompts, tokens, _sampling(body), seed, logprobs,
                             _flag(body, "add_BOS"), _stop_strings(body))


def check_prompts_fit(request: GenerationRequest, tokenize: Any, context: int,
                      vocab_size: int) -> None:
    """Each prompt's ids must be in the model's vocabulary, and the prompt with its new
    tokens must fit the model's context."""
    for i, prompt in enumerate(request.prompts):
        try:
            ids = tokenize(prompt)
        except ValueError as e:  # e.g. NullTokenizer's ids outside its range, lone surrogates
            raise RequestError(f"prompt {i} cannot be tokenized: {e}") from None
        outside = [t for t in ids if not 0 <= t < vocab_size]
        _require(not outside, f"prompt {i} has token id {outside[:1]}, outside the model's "
                 f"vocabulary of {vocab_size}")
        n = len(ids) + int(request.add_bos or not prompt)
        _require(n + request.tokens_to_generate <= context,
                 f"prompt {i} has {n} tokens; with tokens_to_generate "
                 f"{request.tokens_to_generate} that exceeds the model's context of {context}")
