#!/usr/bin/env python
"""Plan a run before launching it: parameters per rank and in total, memory per GPU,
pipeline bubble, FLOPs per iteration, and whether it fits the GPUs.

    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 \\
        --global-batch-size 1536 --tensor-model-parallel-size 8 \\
        --pipeline-model-parallel-size 8 --fp16 --gpu-memory-gb 80

Takes pretrain_gpt.py's flags (the model, layout, batch, precision, recomputation,
--use-distributed-optimizer) plus its own: --world-size (default: one model replica,
tensor x pipeline), --zero-stage (DeepSpeed's ZeRO 0-3 for the memory figures) and
--gpu-memory-gb, and --compare-formulas (print, instead of the plan, the first stage's memory
beside Korthikanti et al. 2022 / Megatron-LM's theoretical_memory_usage.py, with and without
sequence parallelism under each recompute setting: megatron/planning/memory_formulas.py; the
differences are explained in megatron/planning/planner.py). The vocabulary is --vocab-size, or the tokenizer's when --vocab-file or
--tokenizer-name-or-path is given, else GPT-2's 50257. Every rank's stage is built on the
meta device, so nothing is allocated; the formulas are printed with the figures
(megatron/planning/planner.py). Exit status 0 when the plan fits (or no --gpu-memory-gb), 1 when not,
2 on bad flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.assembly.build import build_run_tokenizer
from megatron.checkpointing import checkpoint_model_settings  # noqa: E402
from megatron.config import ConfigError, RunConfig, parse_args  # noqa: E402
from megatron.planning.memory_formulas import compare, format_comparison, variants
from megatron.planning.planner import Plan, build_plan, format_plan  # noqa: E402
from megatron.tokenizer import TokenizerConfigError


def _own_flags() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--gpu-memory-gb", type=float, default=None)
    parser.add_argument("--compare-formulas", action="store_true")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return parser


def plan_config(argv: Sequence[str]) -> tuple[RunConfig, int, Optional[float]]:
    """The run's configuration (vocabulary resolved), ZeRO stage and GPU memory from argv."""
    own, _ = _own_flags().parse_known_args(argv)
    megatron_argv = _without(argv, ("--world-size", "--zero-stage", "--gpu-memory-gb"))
    megatron_argv = [a for a in megatron_argv if a != "--compare-formulas"]
    world = own.world_size or own.tensor_model_parallel_size * own.pipeline_model_parallel_size
    config = parse_args(megatron_argv, world_size=world, require_training=False,
                        checkpoint_settings=checkpoint_model_settings)
    return config.with_vocab_size(_vocab_size(config)), own.zero_stage, own.gpu_memory_gb


def _vocab_size(config: RunConfig) -> int:
    """The tokenizer's vocabulary, as training builds it (NullTokenizer adds its EOD), where
    there are tokenizer files or a NullTokenizer; else --vocab-size, else GPT-2's 50257."""
    d = config.data
    if d.vocab_file or d.tokenizer_name_or_path or d.tokenizer_type == "NullTokenizer":
        try:
            return build_run_tokenizer(config).vocab_size
        except TokenizerConfigError as error:
            raise ConfigError(str(error)) from None
    return d.vocab_size or 50257


def _without(argv: Sequence[str], names: tuple[str, ...]) -> list[str]:
    """argv less the planner's own flags (``--name value`` and ``--name=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif arg.split("=", 1)[0] not in names:
            out.append(arg)
    return out


def main(argv: Optional[Sequence[str]] = None) -> Plan:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        raise SystemExit(0)
    try:
        config, zero_stage, gpu_memory_gb = plan_config(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if "--compare-formulas" in argv:
        print(format_comparison([compare(c, label) for label, c in variants(config)]))
        raise SystemExit(0)
    plan = build_plan(config, zero_stage, gpu_memory_gb)
    print(format_plan(plan))
    return plan


if __name__ == "__main__":
    sys.exit(1 if main().fits is False else 0)
