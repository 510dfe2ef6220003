"""Autoregressive generation of token ids for a batch of prompts of different lengths.

As in Megatron, the prompts are laid out left-aligned in one ``[b, T]`` tensor and every step
runs one new position for the whole batch, starting after the shortest prompt: a sequence
whose prompt is longer takes its own prompt token at that position instead of the sampled one.
So no position ever attends to padding, and with the KV cache each step costs one position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.inference.text_generation.forward import broadcast_from_last_stage, forward_logits
from megatron.inference.text_generation.sampling import SamplingParams, sample
from megatron.model.gpt_model import GPTModel
from megatron.model.kv_cache import KVCache

GREEDY = SamplingParams(top_k=1)

# stop(i, new_ids) -> whether sequence i is complete given its generated ids so far.
StopCheck = Callable[[int, list[int]], bool]


@dataclass
class GenerationOutput:
    """Per prompt: the prompt and generated ids together, how many were the prompt, and the
    log-probability (natural log, of the distribution sampled from) of each generated id."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    logprobs: list[list[float]]

    def new_tokens(self, i: int) -> list[int]:
        return self.tokens[i][self.prompt_lengths[i]:]


def check_prompts(prompts: Sequence[Sequence[int]], max_sequence_length: int,
                  vocab_size: Optional[int] = None, *, to_generate: bool = True) -> None:
    """Raise ValueError for an empty batch, an empty prompt, a token id outside the
    vocabulary, or a prompt with no room to grow (``to_generate``; else longer than the
    context)."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} has no tokens")
        outside = [t for t in p if not 0 <= t < (vocab_size or t + 1)]
        if outside:
            raise ValueError(f"prompt {i} has token id {outside[0]}, outside the model's "
                             f"vocabulary of {vocab_size}")
        if not to_generate and len(p) > max_sequence_length:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than the model's context "
                             f"of {max_sequence_length}")
        if to_generate and len(p) >= max_sequence_length:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the model's context is "
                             f"{max_sequence_length}, which leaves no room to generate")


@torch.no_grad()
def generate_tokens(model: GPTModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    *, params: SamplingParams = GREEDY, seed: int = 0,
                    eod: Optional[int] = None, stop: Optional[StopCheck] = None,
                    use_cache: bool = True, max_sequence_length: Optional[int] = None,
                    device: Optional[torch.device] = None) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` ids after each prompt (lists of ids).

    A sequence ends at ``eod`` (kept in its output), when ``stop`` says so, after
    ``max_new_tokens``, or at the context (``max_sequence_length``, default the model's
    ``max_position_embeddings``). Every rank of the model (all tensor and pipeline ranks)
    calls this with the same arguments and gets the same output. Sampling draws from a
    generator seeded with ``seed`` on the compute device.
    """
    cfg = model.config
    context = max_sequence_length or cfg.max_position_embeddings
    check_prompts(prompts, context, cfg.vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = device or next(model.parameters()).device
    state = _BatchState(prompts, max_new_tokens, context, eod, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(len(prompts), state.total) if use_cache else None
    start = 0
    for pos in range(state.min_prompt, state.total):
        ids = state.tokens[:, start:pos] if use_cache else state.tokens[:, :pos]
        logits = forward_logits(model, ids, cache)  # [b, V] on the last stage
        chosen = torch.zeros(len(prompts), 2, dtype=torch.float64, device=device)
        if logits is not None:
            new = sample(logits, params, cfg.vocab_size, generator)  # [b]
            real = logits[:, :cfg.vocab_size].float()  # the padding is no token
            logprob = torch.log_softmax(real, dim=-1).gather(1, new[:, None])
            chosen = torch.cat([new[:, None].double(), logprob.double()], dim=1)
        chosen = broadcast_from_last_stage(chosen)
        state.take(pos, chosen[:, 0].long(), chosen[:, 1], stop)
        start = pos
        if state.all_done:
            break
    return state.output()


@torch.no_grad()
def score_tokens(model: GPTModel, sequences: Sequence[Sequence[int]], *,
                 max_sequence_length: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list[list[float]]:
    """Per sequence, the log-probability (natural log, over the real vocabulary) of each id
    from the second on, given the ids before it: ``len(seq) - 1`` values. One forward over
    the batch, no sampling (Megatron's scoring, ``tokens_to_generate`` 0). Every rank of the
    model calls it with the same arguments and gets the same values."""
    cfg = model.config
    context = max_sequence_length or cfg.max_position_embeddings
    check_prompts(sequences, context, cfg.vocab_size, to_generate=False)
    device = device or next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)  # [b, s]
    for i, seq in enumerate(sequences):  # causal: the padding after a sequence is unseen
        ids[i, :len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    scores = torch.zeros(len(sequences), width - 1, dtype=torch.float64, device=device)
    logits = forward_logits(model, ids, None, all_positions=True)  # [b, s, V], last stage
    if logits is not None:
        real = logits[:, :-1, :cfg.vocab_size].float()  # the padding is no token
        scores = torch.log_softmax(real, dim=-1).gather(2, ids[:, 1:, None])[..., 0].double()
    scores = broadcast_from_last_stage(scores).tolist()
    return [row[:len(seq) - 1] for row, seq in zip(scores, sequences)]


class _BatchState:
    """The token tensor ``[b, T]`` and which sequences are still generating."""

    def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int,
                 eod: Optional[int], device: torch.device) -> None:
        self.lengths = [len(p) for p in prompts]
        self.min_prompt = min(self.lengths)
        self.total = min(max(self.lengths) + max_new_tokens, context)
        self.limits = [min(n + max_new_tokens, context) for n in self.lengths]
        self.tokens = torch.full((len(prompts), self.total), 0 if eod is None else eod,
                                 dtype=torch.long, device=device)  # [b, T]
        for i, p in enumerate(prompts):
            self.tokens[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self.eod = eod
        self.ends = list(self.lengths)  # one past each sequence's last id
        self.done = [False] * len(prompts)
        self.logprobs: list[list[float]] = [[] for _ in prompts]

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def take(self, pos: int, new: torch.Tensor, logprob: torch.Tensor,
             stop: Optional[StopCheck]) -> None:
        """Position ``pos`` is decided: a prompt token where the prompt reaches it, else the
        sampled ``new`` id for the sequences still generating."""
        generating = [pos >= n and not done for n, done in zip(self.lengths, self.done)]
        mask = torch.tensor(generating, device=self.tokens.device)
        self.tokens[:, pos] = torch.where(mask, new, self.tokens[:, pos])
        new_ids, new_logprobs = new.tolist(), logprob.tolist()
        for i in (i for i, g in enumerate(generating) if g):
            self.ends[i] = pos + 1
            self.logprobs[i].append(new_logprobs[i])
            n = self.lengths[i]
            if (new_ids[i] == self.eod or pos + 1 >= self.limits[i]
                    or (stop is not None and stop(i, self.tokens[i, n:pos + 1].tolist()))):
                self.done[i] = True

    def output(self) -> GenerationOutput:
        rows = self.tokens.tolist()
        return GenerationOutput([row[:end] for row, end in zip(rows, self.ends)],
                                list(self.lengths), self.logprobs)
