"""Multi-level (V-cycle) checkpoint operators: coalesce, de-coalesce, interpolate.

    python tools/multilevel.py coalesce    --load LARGE --save SMALL
    python tools/multilevel.py decoalesce  --load SMALL --save LARGE_SHAPED
    python tools/multilevel.py interpolate --load LARGE --load-small SMALL --alpha 0.25 --save OUT

``coalesce`` halves the width (hidden size, heads, MLP width; head size kept) and the depth;
``decoalesce`` maps a small model back to the large shape (``--load-small`` optional there:
the small checkpoint, for symmetry with interpolate); ``interpolate`` de-coalesces
``--load-small`` and writes ``(1 - alpha) * large + alpha * de-coalesced``. The operators are
``megatron/research/multilevel.py``; see its docstring for the definitions.

Each reads the latest checkpoint of ``--load`` (and ``--load-small``) at whatever tensor,
pipeline and virtual-pipeline layout it was saved with, distributed optimizer or not
(``megatron.conversion.load_full_checkpoint``), and writes ``SAVE/release/``, a model-only
checkpoint with a manifest (``save_full_checkpoint``), at ``--target-tensor-parallel-size`` x
``--target-pipeline-parallel-size`` (default: the layout of the checkpoint read; the coalesced
model must still divide over it). The optimizer state, the learning-rate schedule and the
sample counts are reset: Adam's moments of the large model mean nothing for merged or copied
neurons (train on with ``--load SAVE``, which loads a release checkpoint's model only, or
with ``--finetune``). It prints the model flags to train it with. The coalesced checkpoint
records how it was made (``--pairing``, ``--no-width``, ``--no-depth``) so ``decoalesce`` and
``interpolate`` undo the same thing when given it; a checkpoint saved by training the small
model does not carry that record, so give those flags again when they were not the defaults
(the tool prints what it used).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpointing import CheckpointError, latest_checkpoint  # noqa: E402
from megatron.checkpointing.folder import MEGATRON, no_checkpoint_error  # noqa: E402
from megatron.config import ModelConfig, to_dict  # noqa: E402
from megatron.conversion import (  # noqa: E402
    FullCheckpoint,
    load_full_checkpoint,
    save_full_checkpoint,
)
from megatron.research.multilevel import (  # noqa: E402
    PAIRINGS,
    MultilevelError,
    coalesce,
    decoalesce,
    interpolate,
)

RECORD_KEY = "multilevel"  # top-level entry of a coalesced checkpoint: how it was made


class Operand(NamedTuple):
    """A whole model read from one checkpoint: its state dict and model config (tp 1, one
    stage), the checkpoint it came from, and the record of a coalesce, if any."""

    model: dict
    config: ModelConfig
    source: FullCheckpoint
    record: dict


def read_operand(load_dir: str, flag: str) -> Operand:
    """The whole model of ``load_dir``'s latest checkpoint, saved at any tensor, pipeline and
    virtual-pipeline layout, with or without the distributed optimizer."""
    if not os.path.isdir(load_dir) or latest_checkpoint(load_dir) is None:
        raise no_checkpoint_error(load_dir, flag, namings=(MEGATRON,))
    try:
        full = load_full_checkpoint(load_dir, optimizer=False)  # reset: not even read
    except CheckpointError as error:
        raise CheckpointError(f"{flag} {load_dir}: {error}") from error
    return Operand(full.model, full.model_config(), full, dict(full.extra.get(RECORD_KEY) or {}))


def saved_parallel_sizes(load_dir: str) -> tuple[int, int]:
    """(tensor, pipeline) sizes the latest checkpoint of ``load_dir`` was saved with."""
    return latest_checkpoint(load_dir).layout()


def write_operand(save_dir: str, out: Operand, tp: int, pp: int) -> str:
    """Write ``out`` as a release (model-only) checkpoint at (tp, pp): the optimizer state,
    LR schedule and sample counts are reset. Returns the iteration folder."""
    config = {**out.source.config, "model": to_dict(out.config)}
    full = FullCheckpoint(config=config, model=out.model, release=True,
                          extra={RECORD_KEY: out.record} if out.record else {})
    return save_full_checkpoint(full, save_dir, tp, pp, source="tools/multilevel.py")


def model_flags(config: ModelConfig) -> str:
    return (f"--num-layers {config.num_layers} --hidden-size {config.hidden_size} "
            f"--num-attention-heads {config.num_attention_heads} "
            f"--ffn-hidden-size {config.ffn_hidden_size} --kv-channels {config.kv_channels}")


def _how(args: argparse.Namespace, record: dict) -> dict:
    """Which dimensions and pairing: the coalesced checkpoint's record, else the flags."""
    how = {"width": not args.no_width, "depth": not args.no_depth, "pairing": args.pairing}
    how = {**how, **{k: record[k] for k in how if k in record}}
    how["source"] = "the checkpoint's record" if record else "the flags"
    return how


def run_coalesce(args: argparse.Namespace) -> tuple[Operand, dict]:
    large = read_operand(args.load, "--load")
    how = _how(args, {})
    record = {k: how[k] for k in ("width", "depth", "pairing")}
    small, config = coalesce(large.model, large.config, **record)
    return Operand(small, config, large.source, record), how


def _small_flag(args: argparse.Namespace) -> tuple[str, str]:
    return (args.load_small, "--load-small") if args.load_small else (args.load, "--load")


def run_decoalesce(args: argparse.Namespace) -> tuple[Operand, dict]:
    small = read_operand(*_small_flag(args))
    how = _how(args, small.record)
    model, config = decoalesce(small.model, small.config,
                               **{k: how[k] for k in ("width", "depth", "pairing")})
    return Operand(model, config, small.source, {}), how


def run_interpolate(args: argparse.Namespace) -> tuple[Operand, dict]:
    if args.load_small is None:
        raise MultilevelError("interpolate needs --load-small (the small model to de-coalesce)")
    if args.alpha is None:
        raise MultilevelError("interpolate needs --alpha")
    large = read_operand(args.load, "--load")
    decoalesced, how = run_decoalesce(args)
    shapes = {k: tuple(v.shape) for k, v in large.model.items()}
    if shapes != {k: tuple(v.shape) for k, v in decoalesced.model.items()}:
        raise MultilevelError(f"--load-small {args.load_small} de-coalesces to "
                              f"{model_flags(decoalesced.config)}, but --load {args.load} has "
                              f"{model_flags(large.config)}")
    model = interpolate(large.model, decoalesced.model, args.alpha)
    return Operand(model, large.config, large.source, {}), how


COMMANDS = {"coalesce": run_coalesce, "decoalesce": run_decoalesce,
            "interpolate": run_interpolate}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--load", required=True, help="checkpoint folder to read (the large "
                        "model for coalesce and interpolate, the small one for decoalesce)")
    parser.add_argument("--save", required=True, help="checkpoint folder to write")
    parser.add_argument("--load-small", help="the small (coalesced, then trained) checkpoint")
    parser.add_argument("--alpha", type=float, help="interpolate: weight of the de-coalesced "
                        "model, (1 - alpha) * large + alpha * de-coalesced")
    parser.add_argument("--pairing", choices=PAIRINGS, default="adjacent",
                        help="which neurons and heads merge: neighbours (2i, 2i+1), or i and "
                        "i + n/2 (the authors' code); a coalesced checkpoint's own record wins")
    parser.add_argument("--no-width", action="store_true", help="keep the width")
    parser.add_argument("--no-depth", action="store_true", help="keep the depth")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="tensor-parallel size to save at (default: the size the model "
                        "read was saved with: --load's, --load-small's for decoalesce)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="pipeline-parallel size to save at (default: as the model read)")
    return parser


def target_layout(args: argparse.Namespace) -> tuple[int, int]:
    """The (tp, pp) to save at: the flags, else the layout of the checkpoint the output's
    shape comes from (--load; the small one for decoalesce)."""
    source = _small_flag(args)[0] if args.command == "decoalesce" else args.load
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    for flag, value in (("--target-tensor-parallel-size", tp),
                        ("--target-pipeline-parallel-size", pp)):
        if value is not None and value < 1:
            raise MultilevelError(f"{flag} must be at least 1, got {value}")
    if tp is None or pp is None:
        saved_tp, saved_pp = saved_parallel_sizes(source)
        tp, pp = tp or saved_tp, pp or saved_pp
    return tp, pp


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if os.path.abspath(args.save) in {os.path.abspath(p) for p in (args.load, args.load_small)
                                      if p}:
        print("error: --save must be another folder than --load/--load-small", file=sys.stderr)
        return 1
    try:
        out, how = COMMANDS[args.command](args)
        tp, pp = target_layout(args)
        final = write_operand(args.save, out, tp, pp)
    except (CheckpointError, ValueError) as e:  # MultilevelError and layout errors included
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.command} ({', '.join(k for k in ('width', 'depth') if how[k])}, "
          f"{how['pairing']} pairing, from {how['source']}): wrote {final} at tp={tp}, "
          f"pp={pp} (model only: optimizer state and LR schedule reset); train it with:\n  "
          f"{model_flags(out.config)} --tensor-model-parallel-size {tp} "
          f"--pipeline-model-parallel-size {pp} --load {args.save}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
