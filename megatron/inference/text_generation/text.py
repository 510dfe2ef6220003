"""Generation from text: prompts tokenized, completions detokenized, stop strings applied."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron.inference.text_generation.generation import GREEDY, generate_tokens, score_tokens
from megatron.inference.text_generation.sampling import SamplingParams
from megatron.model.gpt_model import GPTModel


@dataclass
class Completion:
    """One prompt's result: ``text`` is the new text only (cut before a stop string);
    ``tokens`` the prompt's and the new ids; ``logprobs`` one per new id;
    ``prompt_logprobs`` (when asked) one per prompt id from the second on, so that
    ``prompt_logprobs + logprobs`` scores every id of ``tokens`` after the first."""

    prompt: str
    text: str
    tokens: list[int]
    prompt_length: int
    logprobs: list[float]
    prompt_logprobs: list[float] = field(default_factory=list)


def tokenize_prompt(tokenizer: Any, prompt: str, add_bos: bool = False) -> list[int]:
    """The prompt's ids; an empty prompt (or ``add_bos``) starts from the end-of-document id,
    the start of a new document."""
    ids = tokenizer.tokenize(prompt) if prompt else []
    return [tokenizer.eod] + ids if add_bos or not ids else ids


def new_text(tokenizer: Any, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new ids add after the prompt's: detokenized together, so that spacing
    between the prompt and the continuation comes out as the tokenizer writes it."""
    head = tokenizer.detokenize(prompt_ids)
    whole = tokenizer.detokenize(list(prompt_ids) + list(new_ids))
    return whole[len(head):] if whole.startswith(head) else tokenizer.detokenize(new_ids)


def _cut_at_stop(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def generate_text(model: GPTModel, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                  *, params: SamplingParams = GREEDY, seed: int = 0,
                  stop_strings: Sequence[str] = (), stop_on_eod: bool = True,
                  add_bos: bool = False, use_cache: bool = True,
                  prompt_logprobs: bool = False,
                  device: Optional[torch.device] = None) -> list[Completion]:
    """Complete each prompt. A completion ends at the end-of-document token (dropped from the
    text) unless ``stop_on_eod`` is False, at the first of ``stop_strings`` (cut there), or
    after ``max_new_tokens`` tokens. ``prompt_logprobs`` also scores the prompts' own ids;
    ``max_new_tokens`` 0 only scores them (one forward, nothing generated). Every model rank
    calls it with the same arguments."""
    ids = [tokenize_prompt(tokenizer, p, add_bos) for p in prompts]
    scores = (score_tokens(model, ids, device=device) if prompt_logprobs
              else [[] for _ in ids])
    if max_new_tokens == 0:
        return [Completion(p, "", i, len(i), [], s) for p, i, s in zip(prompts, ids, scores)]
    eod = tokenizer.eod if stop_on_eod else None

    def stop(i: int, new_ids: list[int]) -> bool:
        return _cut_at_stop(new_text(tokenizer, ids[i], new_ids), stop_strings)[1]

    out = generate_tokens(model, ids, max_new_tokens, params=params, seed=seed, eod=eod,
                          stop=stop if stop_strings else None, use_cache=use_cache,
                          device=device)
    completions = []
    for i, prompt in enumerate(prompts):
        new = out.new_tokens(i)
        shown = new[:-1] if new and eod is not None and new[-1] == eod else new
        text, _ = _cut_at_stop(new_text(tokenizer, ids[i], shown), stop_strings)
        completions.append(Completion(prompt, text, out.tokens[i], out.prompt_lengths[i],
                                      out.logprobs[i], scores[i]))
    return completions
