"""Multi-level (V-cycle) checkpoint operators: coalesce, de-coalesce, interpolate.

    python tools/multilevel.py coalesce    --load LARGE --save SMALL
    python tools/multilevel.py decoalesce  --load SMALL --save LARGE_SHAPED
    python tools/multilevel.py interpolate --load LARGE --load-small SMALL --alpha 0.25 --save OUT

``coalesce`` halves the width (hidden size, heads, MLP width; head size kept) and the depth;
``decoalesce`` maps a small model back to the large shape (``--load-small`` optional there:
the small checkpoint, for symmetry with interpolate); ``interpolate`` de-coalesces
``--load-small`` and writes ``(1 - alpha) * large + alpha * de-coalesced``. The operators are
``megatron/multilevel.py``; see its docstring for the definitions.

Each reads the latest checkpoint of ``--load`` (tensor and pipeline size 1) and writes
``SAVE/release/mp_rank_00/model_optim_rng.pt``, a model-only checkpoint with a manifest: the
optimizer state and the learning-rate schedule are reset (train on with ``--load SAVE``, which
loads a release checkpoint's model only, or with ``--finetune``) and it prints the model flags
to train it with. The coalesced checkpoint records how it was made (``--pairing``,
``--no-width``, ``--no-depth``) so ``decoalesce`` and ``interpolate`` undo the same thing when
given it; a checkpoint saved by training the small model does not carry that record, so give
those flags again when they were not the defaults (the tool prints what it used).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpointing import (  # noqa: E402
    CHECKPOINT_VERSION,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    CheckpointError,
    mp_rank_dir_name,
    read_tracker,
)
from megatron.checkpointing.files import read_torch, write_text_atomic, write_torch  # noqa: E402
from megatron.checkpointing.manifest import build_manifest, write_manifest  # noqa: E402
from megatron.checkpointing.paths import resolve_iteration_dir, saved_layout  # noqa: E402
from megatron.config import ModelConfig, to_dict  # noqa: E402
from megatron.file_modes import chmod_as_created  # noqa: E402
from megatron.multilevel import (  # noqa: E402
    PAIRINGS,
    MultilevelError,
    coalesce,
    decoalesce,
    interpolate,
)

RECORD_KEY = "multilevel"  # top-level entry of a coalesced checkpoint: how it was made


class FullCheckpoint(NamedTuple):
    """A whole model read from one checkpoint: its state dict, model config, the run config
    it was saved with (plain dicts) and the record of a coalesce, if any."""

    model: dict
    config: ModelConfig
    run_config: dict
    record: dict


# ---------------------------------------------------------------------------------------------
# The one place that reads and writes checkpoint folders. Only tensor and pipeline size 1 for
# now; megatron/conversion (load_full_checkpoint / save_full_checkpoint, any layout) replaces
# these two functions when it lands.


def read_full_checkpoint(load_dir: str, flag: str) -> FullCheckpoint:
    tracker = read_tracker(load_dir) if os.path.isdir(load_dir) else None
    if tracker is None:
        raise CheckpointError(f"{flag} {load_dir} holds no checkpoint ({TRACKER_FILENAME} "
                              "is missing)")
    iter_dir = resolve_iteration_dir(load_dir, tracker)
    tp, pp = saved_layout(iter_dir)
    if (tp, pp) != (1, 1):
        raise CheckpointError(f"{flag} {load_dir}: {iter_dir} was saved with tensor-model-"
                              f"parallel size {tp} and pipeline-model-parallel size {pp}; "
                              "tools/multilevel.py reads tp=1, pp=1 checkpoints only (save "
                              "one at that layout first)")
    state = read_torch(os.path.join(iter_dir, mp_rank_dir_name(0, 0, 1), MODEL_FILENAME))
    if "model" not in state:
        raise CheckpointError(f"{flag} {load_dir}: {iter_dir} holds no 'model' entry (a "
                              "virtual-pipeline checkpoint?); the operators need one model")
    run_config = state.get("config")
    if not isinstance(run_config, dict) or not isinstance(run_config.get("model"), dict):
        raise CheckpointError(f"{flag} {load_dir}: {iter_dir} stores no model config")
    return FullCheckpoint(dict(state["model"]), model_config_from_dict(run_config["model"]),
                          run_config, dict(state.get(RECORD_KEY) or {}))


def model_config_from_dict(fields: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in names})


def write_full_checkpoint(save_dir: str, model: dict, config: ModelConfig, run_config: dict,
                          record: dict) -> str:
    """Write ``SAVE/release`` (model only, with a manifest) and point the tracker at it."""
    run_config = {**run_config, "model": to_dict(config)}
    layout = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
              "data_parallel_size": 1, "num_model_chunks": 1}
    state: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "model": model,
        "config": run_config, "parallel_layout": layout,
        "consumed_train_samples": 0, "consumed_valid_samples": 0,
    }
    if record:
        state[RECORD_KEY] = record
    os.makedirs(save_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="release.tmp-", dir=save_dir)
    try:
        chmod_as_created(tmp)
        rel = os.path.join(mp_rank_dir_name(0, 0, 1), MODEL_FILENAME)
        os.makedirs(os.path.dirname(os.path.join(tmp, rel)))
        digest = write_torch(state, os.path.join(tmp, rel))
        write_manifest(tmp, build_manifest(0, layout, run_config, {rel: digest}))
        final = os.path.join(save_dir, "release")
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text_atomic(os.path.join(save_dir, TRACKER_FILENAME), "release")
    return final


# ---------------------------------------------------------------------------------------------


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


def run_coalesce(args: argparse.Namespace) -> tuple[FullCheckpoint, dict]:
    large = read_full_checkpoint(args.load, "--load")
    how = _how(args, {})
    record = {k: how[k] for k in ("width", "depth", "pairing")}
    small, config = coalesce(large.model, large.config, **record)
    return FullCheckpoint(small, config, large.run_config, record), how


def run_decoalesce(args: argparse.Namespace) -> tuple[FullCheckpoint, dict]:
    small = read_full_checkpoint(args.load_small or args.load, "--load-small" if args.load_small
                                 else "--load")
    how = _how(args, small.record)
    model, config = decoalesce(small.model, small.config,
                               **{k: how[k] for k in ("width", "depth", "pairing")})
    return FullCheckpoint(model, config, small.run_config, {}), how


def run_interpolate(args: argparse.Namespace) -> tuple[FullCheckpoint, dict]:
    if args.load_small is None:
        raise MultilevelError("interpolate needs --load-small (the small model to de-coalesce)")
    if args.alpha is None:
        raise MultilevelError("interpolate needs --alpha")
    large = read_full_checkpoint(args.load, "--load")
    decoalesced, how = run_decoalesce(args)
    shapes = {k: tuple(v.shape) for k, v in large.model.items()}
    if shapes != {k: tuple(v.shape) for k, v in decoalesced.model.items()}:
        raise MultilevelError(f"--load-small {args.load_small} de-coalesces to "
                              f"{model_flags(decoalesced.config)}, but --load {args.load} has "
                              f"{model_flags(large.config)}")
    model = interpolate(large.model, decoalesced.model, args.alpha)
    return FullCheckpoint(model, large.config, large.run_config, {}), how


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
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if os.path.abspath(args.save) in {os.path.abspath(p) for p in (args.load, args.load_small)
                                      if p}:
        print("error: --save must be another folder than --load/--load-small", file=sys.stderr)
        return 1
    try:
        out, how = COMMANDS[args.command](args)
        final = write_full_checkpoint(args.save, out.model, out.config, out.run_config,
                                      out.record)
    except (CheckpointError, MultilevelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.command} ({', '.join(k for k in ('width', 'depth') if how[k])}, "
          f"{how['pairing']} pairing, from {how['source']}): wrote {final} (model only: optimizer state reset); "
          f"train it with:\n  {model_flags(out.config)} --load {args.save}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
