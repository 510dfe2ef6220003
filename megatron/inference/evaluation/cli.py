"""``tasks/main.py --task WIKITEXT103|LAMBADA``: Megatron's zero-shot evaluation command.

    torchrun --nproc_per_node 2 tasks/main.py --task WIKITEXT103 \
        --valid-data wikitext-103/wiki.test.tokens --overlapping-eval 32 \
        --tensor-model-parallel-size 2 --load CKPT --num-layers 24 ... \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --micro-batch-size 8

takes the model, tokenizer and parallel flags of pretrain_gpt.py plus the task's flags
(``--task``, ``--valid-data``, ``--overlapping-eval``, ``--strict-lambada``, and ours:
``--hf-model DIR`` for a local Hugging Face GPT-2 folder instead of ``--load``), and prints
Megatron's result line. Any tensor/pipeline layout evaluates any checkpoint: at the layout it
was saved with each rank reads its own file, otherwise the checkpoint (or the HF folder) is
merged and cut for this layout in memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Union

from megatron.assembly.build import build_run_tokenizer
from megatron.assembly.initialize import initialize_megatron
from megatron.checkpointing import CheckpointError, checkpoint_model_settings
from megatron.config import RunConfig, parse_args_or_exit, print_config
from megatron.inference.evaluation.datasets import (
    EvaluationDataError,
    LambadaDataset,
    build_wikitext_dataset,
)
from megatron.inference.evaluation.model import build_model_for_evaluation
from megatron.inference.evaluation.zeroshot import (
    TASKS,
    AccuracyResult,
    PerplexityResult,
    accuracy_result,
    evaluate_dataset,
    format_accuracy,
    format_perplexity,
    perplexity_result,
)
from megatron.inference.loading import (
    InferenceLoadingError,
    hf_model_settings,
    hf_tokenizer_settings,
)
from megatron.platform.output import print_rank_0


def add_task_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The task flags (Megatron's tasks/main.py spellings), as an extra_args_provider."""
    group = parser.add_argument_group("zero-shot tasks")
    group.add_argument("--task", required=True, choices=TASKS,
                       help="WIKITEXT103 (perplexity) or LAMBADA (last-word accuracy).")
    group.add_argument("--valid-data", nargs="*", default=None,
                       help="The evaluation file: WikiText text, or LAMBADA JSON lines "
                       "(default: unset).")
    group.add_argument("--overlapping-eval", type=int, default=32,
                       help="WIKITEXT103: stride of the sliding windows; each scores its last "
                       "N targets; 0: --seq-length, windows side by side (default: 32).")
    group.add_argument("--strict-lambada", action="store_true",
                       help="LAMBADA: the whole last word must be predicted, not its last "
                       "token.")
    group.add_argument("--hf-model", default=None, metavar="DIR",
                       help="Evaluate a local Hugging Face GPT-2 folder (converted in memory, "
                       "at any tensor/pipeline layout) instead of --load (default: unset).")
    return parser


def _hf_defaults(argv: list[str]) -> dict[str, Any]:
    """With --hf-model DIR: the model flags of its config.json and its tokenizer files (when
    the folder has them), as defaults that flags on the command line override."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--hf-model", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.hf_model is None:
        return {}
    defaults = hf_model_settings(known.hf_model)
    tokenizer = hf_tokenizer_settings(known.hf_model)
    if tokenizer is not None and tokenizer["tokenizer_type"] == "GPT2BPETokenizer":
        defaults.update(vocab_file=tokenizer["vocab_file"], merge_file=tokenizer["merge_file"])
    return defaults


def parse_task_args(argv: Optional[list[str]] = None) -> RunConfig:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        defaults = _hf_defaults(argv)
    except (InferenceLoadingError, OSError, ValueError) as error:
        _fail(str(error))
    cfg = parse_args_or_exit(argv, add_task_args, defaults=defaults, require_training=False,
                             checkpoint_settings=checkpoint_model_settings)
    extra = cfg.extra
    if not extra["valid_data"] or len(extra["valid_data"]) != 1:
        _fail("--valid-data takes exactly one file")
    if not os.path.isfile(extra["valid_data"][0]):
        _fail(f"--valid-data {extra['valid_data'][0]}: no such file")
    if extra["hf_model"] is None and cfg.checkpoint.load is None:
        _fail("nothing to evaluate: give --load CHECKPOINT_DIR or --hf-model HF_GPT2_DIR")
    return cfg


def _fail(message: str, status: int = 2):
    """``error: message`` on stderr and exit: 2 for bad input (as argparse), 1 for a damaged
    or mismatched checkpoint (as pretrain_gpt.py)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def build_task_dataset(cfg: RunConfig, tokenizer: Any):
    extra = cfg.extra
    path = extra["valid_data"][0]
    if extra["task"] == "LAMBADA":
        return LambadaDataset(path, tokenizer, cfg.model.seq_length, extra["strict_lambada"])
    stride = extra["overlapping_eval"] or cfg.model.seq_length
    return build_wikitext_dataset(path, tokenizer, cfg.model.seq_length, stride)


def run_task(cfg: RunConfig) -> Union[PerplexityResult, AccuracyResult]:
    """Initialize, build the tokenizer, dataset and model, evaluate, print the result line;
    returns the result (on every rank)."""
    try:
        tokenizer = build_run_tokenizer(cfg)
        dataset = build_task_dataset(cfg, tokenizer)
    except (EvaluationDataError, ValueError, OSError) as error:
        _fail(str(error))
    device = initialize_megatron(cfg)
    cfg = cfg.with_vocab_size(tokenizer.vocab_size)
    print_config(cfg, print_fn=print_rank_0)
    chunks, _ = build_model_for_evaluation(cfg, device, cfg.extra["hf_model"])
    sums = evaluate_dataset(cfg, chunks, dataset, device=device)
    task = cfg.extra["task"]
    if task == "LAMBADA":
        result = accuracy_result(sums)
        print_rank_0(format_accuracy(task, result))
    else:
        result = perplexity_result(sums, dataset.num_tokenized_tokens,
                                   dataset.num_original_tokens)
        print_rank_0(format_perplexity(task, result))
    print_rank_0("done :-)")
    return result


def main(argv: Optional[list[str]] = None) -> Union[PerplexityResult, AccuracyResult]:
    cfg = parse_task_args(argv)
    try:
        return run_task(cfg)
    except CheckpointError as error:
        _fail(str(error), status=1)
    except InferenceLoadingError as error:
        _fail(str(error))
