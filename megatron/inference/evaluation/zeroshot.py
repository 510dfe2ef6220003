"""Forward-only evaluation over any parallel layout, and Megatron's result lines.

Each data-parallel rank takes its share of the examples in micro-batches of
``micro_batch_size`` (the last ones padded with unscored examples, so every rank runs the
same number and every micro-batch has the shape the pipeline stages exchange). The pipeline
schedule of training runs them forward only. On the last stage each micro-batch yields sums:
the loss of the scored targets, their count, the examples whose scored targets were all
predicted right, and the examples. They are added over micro-batches, summed over the
data-parallel group and sent to every stage of the pipeline; tensor-parallel ranks compute
the same sums and are not added together.

The vocabulary padding (ids from the tokenizer's size up to the padded size) is not text:
its logits are excluded from the softmax and the argmax, so a model converted from Hugging
Face gives Hugging Face's numbers.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron.config import RunConfig
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel.schedules import StageInfo, get_forward_backward_func
from megatron.model.masks import get_ltor_masks_and_position_ids
from megatron.platform.output import print_rank_0
from megatron.platform.progress import percent_and_eta

TASKS = ("WIKITEXT103", "LAMBADA")
_SUM_NAMES = ("loss_sum", "scored_tokens", "correct", "examples")


class EvaluationSums(NamedTuple):
    """Totals over the whole dataset (every data-parallel rank's share)."""

    loss_sum: float  # summed cross entropy (nats) of the scored targets
    scored_tokens: int
    correct: int  # examples whose scored targets were all predicted right (greedy)
    examples: int


def _micro_batches(dataset: Any, micro_batch_size: int, num_micro_batches: int,
                   dp_rank: int, dp_size: int, device: torch.device) -> Iterator[dict]:
    """This data-parallel rank's micro-batches; round r holds examples
    ``[(r * dp_size + dp_rank) * micro_batch_size, ... + micro_batch_size)``."""
    n = len(dataset)
    for r in range(num_micro_batches):
        first = (r * dp_size + dp_rank) * micro_batch_size
        items, real = [], []
        for i in range(first, first + micro_batch_size):
            items.append(dataset[min(i, n - 1)])
            real.append(1.0 if i < n else 0.0)  # a padding example is never scored
        text = torch.from_numpy(_stack(items, "text")).to(device)
        mask = torch.from_numpy(_stack(items, "pad_mask")).to(device)
        real_t = torch.tensor(real, device=device)
        yield {"text": text, "pad_mask": mask * real_t[:, None], "real": real_t}


def _stack(items: list[dict], key: str) -> np.ndarray:
    return np.stack([item[key] for item in items])


def _mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's logits ``[b, s, V/tp]`` in fp32 (fp32 input is changed in place) with the
    padding ids at -1e30 (finite, so a rank whose slice is all padding still has a
    well-defined local softmax)."""
    logits = logits.float()
    part = logits.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * part
    if start + part > vocab_size:
        logits[..., max(vocab_size - start, 0):] = -1e30
    return logits


def _vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token ids ``[b, s]`` from vocab-split logits ``[b, s, V/tp]`` without gathering
    them: each rank's best (value, id), then the first rank holding the overall maximum,
    which is ``argmax``'s first-index rule over the whole vocabulary."""
    local_id = logits.argmax(dim=-1)  # [b, s]
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local_id
    local_max = logits.gather(-1, local_id.unsqueeze(-1)).squeeze(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * logits.size(-1)
    maxima = [torch.empty_like(local_max) for _ in range(tp)]
    ids = [torch.empty_like(local_id) for _ in range(tp)]
    dist.all_gather(maxima, local_max.contiguous(), group=group)
    dist.all_gather(ids, (local_id + start).contiguous(), group=group)
    best_rank = torch.stack(maxima).argmax(dim=0)  # [b, s], the first rank on ties
    return torch.stack(ids).gather(0, best_rank.unsqueeze(0)).squeeze(0)


def _batch_sums(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                real: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """Sums of one micro-batch from vocab-parallel logits ``[b, s, V/tp]``."""
    logits = _mask_vocab_padding(logits, vocab_size)
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)  # [b, s]
    predicted = _vocab_parallel_argmax(logits)  # [b, s]
    right = (predicted == labels) | (mask == 0)
    correct = right.all(dim=-1).float() * real  # [b]
    return {"loss_sum": (losses * mask).sum().double(), "scored_tokens": mask.sum().double(),
            "correct": correct.sum().double(), "examples": real.sum().double()}


def _forward_step(cfg: RunConfig, data_iterator, model: nn.Module, stage: StageInfo):
    tokens = labels = mask = real = position_ids = attention_mask = None
    if stage.is_first or stage.is_last:
        batch = next(data_iterator)
        text = batch["text"]  # [b, s + 1]
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        mask, real = batch["pad_mask"], batch["real"]
        d = cfg.data
        attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
            tokens, None, d.reset_position_ids, d.reset_attention_mask, False)
    output = model(tokens, position_ids, attention_mask)

    def sums(logits: torch.Tensor):
        values = _batch_sums(logits, labels, mask, real, cfg.model.vocab_size)
        return logits.new_zeros(()), values

    return output, sums


def _reduce(per_micro_batch: list[dict], device: torch.device) -> torch.Tensor:
    """Sum over micro-batches, then over data parallel; every pipeline stage gets the last
    stage's totals."""
    totals = torch.zeros(len(_SUM_NAMES), dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for values in per_micro_batch:
            totals += torch.stack([values[name].to(device) for name in _SUM_NAMES])
    if dist.is_initialized():
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
    return totals


def _rounds(num_examples: int, micro_batch_size: int) -> int:
    """Micro-batches per data-parallel rank: all examples, a multiple of the pipeline size
    (the interleaved schedule needs it; the extra ones are unscored padding)."""
    dp = parallel_state.get_data_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rounds = math.ceil(num_examples / (micro_batch_size * dp))
    return math.ceil(rounds / pp) * pp


def _progress_line(done: int, rounds: int, seconds: float) -> str:
    """After each ``--log-interval`` micro-batches: how far, the ETA, the pace."""
    return (f"> evaluated {done} of {rounds} micro-batches, "
            f"{percent_and_eta(done / rounds, seconds)} "
            f"({done / max(seconds, 1e-9):.2f} micro-batches/s)")


def evaluate_dataset(cfg: RunConfig, chunks: Sequence[nn.Module], dataset: Any,
                     micro_batch_size: Optional[int] = None, device: Optional[torch.device] = None,
                     log_interval: Optional[int] = None) -> EvaluationSums:
    """Run ``dataset`` through the model (all ranks call it); the totals, on every rank.
    Rank 0 prints a progress line with the ETA every ``log_interval`` micro-batches (default
    ``--log-interval``; rounded to a multiple of the pipeline size)."""
    device = device or parallel_state.get_default_device()
    mbs = micro_batch_size or cfg.training.micro_batch_size
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rounds = _rounds(len(dataset), mbs)
    batches = _micro_batches(dataset, mbs, rounds, parallel_state.get_data_parallel_rank(),
                             parallel_state.get_data_parallel_world_size(), device)
    schedule = get_forward_backward_func()
    step = functools.partial(_forward_step, cfg)  # the schedule passes ``stage``
    per_call = pp * max(1, (log_interval or cfg.logging.log_interval) // pp)
    results: list[dict] = []
    for chunk in chunks:
        chunk.eval()
    print_rank_0(f"> evaluating {len(dataset)} examples: {rounds} micro-batches of {mbs} per "
                 "data-parallel rank")
    start = time.time()
    with torch.no_grad():
        for done in range(0, rounds, per_call):
            count = min(per_call, rounds - done)
            results += schedule(forward_step_func=step, data_iterator=batches, model=list(chunks),
                                num_microbatches=count, seq_length=cfg.model.seq_length,
                                micro_batch_size=mbs, forward_only=True)
            print_rank_0(_progress_line(done + count, rounds, time.time() - start))
    totals = _reduce(results, device).tolist()
    return EvaluationSums(totals[0], int(round(totals[1])), int(round(totals[2])),
                          int(round(totals[3])))


# Results -----------------------------------------------------------------------------------


class PerplexityResult(NamedTuple):
    avg_loss: float  # nats per tokenized token
    ppl: float
    adjusted_ppl: float  # per original (word-level) token
    token_ratio: float


class AccuracyResult(NamedTuple):
    correct: int
    total: int
    accuracy: float


def perplexity_result(sums: EvaluationSums, num_tokenized_tokens: int,
                      num_original_tokens: int) -> PerplexityResult:
    """Megatron's WikiText numbers: loss per target token, and the perplexity per original
    (whitespace-separated) token, through the ratio of the two counts."""
    targets = num_tokenized_tokens - 1
    avg_loss = sums.loss_sum / targets
    token_ratio = targets / max(num_original_tokens - 1, 1)
    return PerplexityResult(avg_loss, math.exp(min(20.0, avg_loss)),
                            math.exp(min(20.0, avg_loss * token_ratio)), token_ratio)


def accuracy_result(sums: EvaluationSums) -> AccuracyResult:
    return AccuracyResult(sums.correct, sums.examples, sums.correct / max(sums.examples, 1))


def _framed(line: str) -> str:
    bar = "-" * (len(line) + 1)
    return f"{bar}\n{line}\n{bar}"


def format_perplexity(task: str, r: PerplexityResult) -> str:
    return _framed(f" validation results on {task} | avg loss: {r.avg_loss:.4E} | "
                   f"ppl: {r.ppl:.4E} | adjusted ppl: {r.adjusted_ppl:.4E} | "
                   f"token ratio: {r.token_ratio} |")


def format_accuracy(task: str, r: AccuracyResult) -> str:
    return _framed(f" validation results on {task} | number correct: {r.correct:.4E} | "
                   f"total examples: {r.total:.4E} | avg accuracy: {r.accuracy:.4E}")
