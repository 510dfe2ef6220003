"""The command line (and ``--config FILE``) -> one validated ``RunConfig``.

The parser is generated from the slices' field declarations: each flag, alias, default and
help text is written once, in the slice that owns the value. Flags keep the spellings of
Megatron-LM and Megatron-DeepSpeed (old aliases included). A TOML file given with ``--config``
sets values first; flags on the command line override it. Every check runs here, before any
process group exists, and fails with a ``ConfigError`` naming the flag (or the file and key).

    config = parse_args()                        # sys.argv; world size from WORLD_SIZE
    config = parse_args(argv, world_size=64)     # explicit
    print_config(config)                         # Megatron's "arguments" block
    config = config.with_vocab_size(tokenizer.vocab_size)   # once the tokenizer is built

Entry scripts call ``parse_args_or_exit``, which prints ``error: ...`` to stderr and exits
with status 2 as argparse would.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from megatron.config import compat
from megatron.config.base import (
    ConfigError,
    cli_default,
    field_default,
    flag,
    flags_of,
    option_fields,
    value_type,
)
from megatron.config.data import DataConfig, canonical_tokenizer_type
from megatron.config.run import SLICE_CLASSES, RunConfig
from megatron.config.toml_io import dump_config, toml_settings
from megatron.platform.output import global_rank, print_rank_0, refuse

ExtraArgsProvider = Callable[[argparse.ArgumentParser], Optional[argparse.ArgumentParser]]
# --load -> the model-shape values stored with its latest checkpoint (--use-checkpoint-args).
CheckpointSettings = Callable[[str], Mapping[str, Any]]

_TITLES = {
    "model": "model", "parallel": "parallelism", "optimizer": "optimizer and mixed precision",
    "scheduler": "learning-rate schedule", "data": "data and tokenizer",
    "training": "training", "checkpoint": "checkpointing", "logging": "logging",
    "deepspeed": "DeepSpeed",
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


# ----------------------------------------------------------------------------- the parser


def _help(f: dataclasses.Field, switch: bool) -> str:
    text = f.metadata["help"]
    if f.metadata.get("required"):
        return f"{text} (required)"
    if switch or "(default:" in text:  # a help text may say its default in its own words
        return text
    default = cli_default(f)
    if isinstance(default, tuple):
        default = " ".join(map(str, default))
    return f"{text} (default: {'unset' if default is None else default})"


def _add_field(group: Any, cls: type, f: dataclasses.Field) -> None:
    meta = f.metadata
    action = meta["action"]
    if action is None and value_type(cls, f) is bool:
        action = "store_true"
    kwargs: dict[str, Any] = {"dest": f.name, "default": cli_default(f)}
    if action is not None:
        kwargs["action"] = action
        if action == "store_const":
            kwargs["const"] = meta["const"]
    else:
        kwargs["type"] = value_type(cls, f)
        for key in ("choices", "nargs", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
    kwargs["help"] = _help(f, switch=action is not None)
    group.add_argument(*flags_of(f), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The full Megatron-compatible parser (without any extra provider's flags)."""
    parser = _Parser(description="Megatron-compatible GPT pre-training", allow_abbrev=False)
    files = parser.add_argument_group("configuration files")
    files.add_argument("--config", default=None, metavar="FILE",
                       help="Read settings from a TOML file (tables [model], [parallel], ...); "
                       "flags given here override it (default: unset).")
    files.add_argument("--dump-config", default=None, metavar="FILE",
                       help="Write the effective configuration to FILE as TOML, then go on "
                       "(with --dry-run: print the plan and train nothing) (default: unset).")
    for name, cls in SLICE_CLASSES.items():
        group = parser.add_argument_group(_TITLES[name])
        for f in option_fields(cls):
            _add_field(group, cls, f)
    compat.add_compat_flags(parser)
    return parser


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.dest not in (argparse.SUPPRESS, "help")}


_FILE_DESTS = ("config", "dump_config")


def unmapped_flags(parser: Optional[argparse.ArgumentParser] = None) -> list[str]:
    """Parser destinations that no config field receives (should be empty; a test checks)."""
    fields = {f.name for cls in SLICE_CLASSES.values() for f in option_fields(cls)}
    handled = fields | set(compat.NO_OP_FLAGS) | set(compat.TRANSLATED_FLAGS) \
        | set(_FILE_DESTS)
    return sorted(_dests(parser or build_parser()) - handled)


# ----------------------------------------------------------------------------- parsing


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[ExtraArgsProvider] = None,
    world_size: Optional[int] = None,
    *,
    defaults: Optional[Mapping[str, Any]] = None,
    require_training: bool = True,
    xla_spmd_devices: Optional[int] = None,
    announce: bool = True,
    checkpoint_settings: Optional[CheckpointSettings] = None,
) -> RunConfig:
    """Parse Megatron flags (and ``--config FILE``) into a validated RunConfig.

    argv: the flags (default ``sys.argv[1:]``). extra_args_provider: Megatron's hook,
    ``provider(parser) -> parser``, adding flags whose values land in ``config.extra``; it may
    also ``parser.set_defaults(train_iters=..., mock_data=True)`` to satisfy requirements.
    world_size: default the WORLD_SIZE environment variable, else 1. defaults: field -> value
    used when neither the command line nor the file gives it (Megatron's ``defaults``).
    require_training=False drops the requirements that only training has (a schedule length,
    a data source, tokenizer files). xla_spmd_devices: the XLA devices each process trains
    over with SPMD (each a data-parallel rank; megatron.training.xla_step decides). announce=False
    keeps the no-op flags' notices for a second reading of the same flags.
    checkpoint_settings: what --use-checkpoint-args reads (the entry points that take the flag
    pass ``megatron.checkpointing.checkpoint_model_settings``; the config package reads no
    checkpoint itself).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    own = _dests(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    extra_dests = _dests(parser) - own
    if defaults:
        _apply_defaults(parser, defaults)
    files, _ = parser.parse_known_args(argv)
    if files.config is not None:
        extra_defaults = {d: parser.get_default(d) for d in extra_dests}
        parser.set_defaults(**toml_settings(files.config, extra_defaults))
        files, _ = parser.parse_known_args(argv)
    if files.use_checkpoint_args:
        parser.set_defaults(**_checkpoint_settings(files.load, checkpoint_settings))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(_unknown_flags_message(parser, unknown))
    _check_required(ns, require_training)
    compat.translate(ns)
    if announce:
        compat.announce_no_ops(ns)
    config = _build_run_config(ns, _resolve_world_size(world_size), extra_dests,
                               xla_spmd_devices)
    if announce and config.optimizer.use_syncfree_optim and not ns.use_syncfree_optim:
        print_rank_0("> on an XLA device --check-for-nan-in-loss-and-grad skips a NaN/Inf step "
                     "with torch_xla's sync-free optimizer: --use-syncfree-optim chosen "
                     "(--no-check-for-nan-in-loss-and-grad keeps torch's optimizer)")
    if ns.dump_config is not None and global_rank() == 0:
        dump_config(config, ns.dump_config)
        # Said at once: a user who meant only to dump sees it before any training starts.
        stop = "" if config.training.dry_run else "; --dry-run to stop here"
        print(f"wrote {ns.dump_config} (the whole configuration{stop})", flush=True)
    return config


def _checkpoint_settings(load_dir: Optional[str],
                         reader: Optional[CheckpointSettings]) -> Mapping[str, Any]:
    if load_dir is None:
        raise ConfigError("--use-checkpoint-args needs --load (the checkpoint to read)")
    if reader is None:
        raise ConfigError("--use-checkpoint-args: this caller of parse_args reads no checkpoint "
                          "(it passes no checkpoint_settings, such as "
                          "megatron.checkpointing.checkpoint_model_settings)")
    return reader(load_dir)


def parse_args_or_exit(*args: Any, **kwargs: Any) -> RunConfig:
    """``parse_args`` for entry scripts: on bad input print ``error: ...`` (on global rank 0
    only: every rank of a launch reads the same flags) and exit with 2."""
    try:
        return parse_args(*args, **kwargs)
    except ConfigError as error:
        refuse(str(error))


def _apply_defaults(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    unknown = sorted(set(defaults) - _dests(parser))
    if unknown:
        raise ConfigError(f"defaults name no flag: {', '.join(unknown)}")
    parser.set_defaults(**defaults)


def _unknown_flags_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    if not flags:
        return f"unexpected positional arguments: {' '.join(unknown)}"
    known = list(parser._option_string_actions)
    hints, missing = [], []
    for name in flags:
        feature = compat.missing_feature(name)
        if feature is not None:  # a peer's flag: say what it is, not a neighbour's name
            missing.append(f"{name}: not supported yet ({feature})")
            continue
        # Close enough to be a typo only (--hiden-size), not another feature's flag.
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    parts = missing + ([f"unrecognized arguments: {', '.join(hints)}"] if hints else [])
    return "; ".join(parts)


def _resolve_world_size(world_size: Optional[int]) -> int:
    if world_size is None:
        # torchrun and the deepspeed launcher set WORLD_SIZE; srun sets SLURM_NTASKS.
        name = "WORLD_SIZE" if "WORLD_SIZE" in os.environ or "SLURM_NTASKS" not in os.environ \
            else "SLURM_NTASKS"
        raw = os.environ.get(name, "1")
        try:
            world_size = int(raw)
        except ValueError:
            raise ConfigError(f"{name} environment variable is not an integer: {raw!r}") from None
    if world_size < 1:
        raise ConfigError(f"world size must be positive, got {world_size}")
    return world_size


def _required_fields() -> list[str]:
    return [f.name for cls in SLICE_CLASSES.values() for f in option_fields(cls)
            if f.metadata.get("required")]


def _check_required(ns: argparse.Namespace, require_training: bool) -> None:
    missing = [flag(name) for name in _required_fields() if getattr(ns, name) is None]
    if require_training:
        if ns.train_iters is None and ns.train_samples is None:
            missing.append("--train-iters or --train-samples")
        if not (ns.mock_data or ns.data_path or ns.train_data_path or ns.valid_data_path
                or ns.test_data_path):
            missing.append("a data source (--data-path, --train-data-path/--valid-data-path/"
                           "--test-data-path, or --mock-data)")
        kind = canonical_tokenizer_type(ns.tokenizer_type)
        gpt2_without_files = (kind == "GPT2BPETokenizer" and ns.vocab_file is None
                              and ns.merge_file is None)
        if not (ns.mock_data and gpt2_without_files):
            # Mock data needs no tokenizer: the model then uses GPT-2's vocabulary size.
            data = DataConfig(tokenizer_type=kind, vocab_file=ns.vocab_file,
                              merge_file=ns.merge_file, vocab_size=ns.vocab_size,
                              tokenizer_name_or_path=ns.tokenizer_name_or_path)
            missing += data.tokenizer_inputs_missing()
    if missing:
        raise ConfigError("missing required flags: " + "; ".join(missing))


def _fill(cls: type, ns: argparse.Namespace, **internal: Any) -> Any:
    """An instance of slice ``cls`` from the namespace values of its option fields."""
    kwargs = {f.name: getattr(ns, f.name) for f in option_fields(cls)}
    return cls(**kwargs, **internal)


def _build_run_config(ns: argparse.Namespace, world_size: int, extra_dests: set[str],
                      xla_spmd_devices: Optional[int] = None) -> RunConfig:
    parallel = {"world_size": world_size, "xla_spmd_devices": xla_spmd_devices}
    slices = {name: _fill(cls, ns, **(parallel if name == "parallel" else {}))
              for name, cls in SLICE_CLASSES.items()}
    return RunConfig(**slices, extra={dest: getattr(ns, dest) for dest in sorted(extra_dests)})


# ----------------------------------------------------------------------------- printing


def flatten_config(config: RunConfig) -> dict[str, Any]:
    """Every field of every slice by name (one entry per name), plus derived sizes and extras."""
    flat: dict[str, Any] = {}
    for slice_name in RunConfig.SLICES:
        sub = getattr(config, slice_name)
        for f in dataclasses.fields(sub):
            flat.setdefault(f.name, getattr(sub, f.name))
    flat["data_parallel_size"] = config.data_parallel_size
    flat["padded_vocab_size"] = config.model.padded_vocab_size
    flat["num_micro_batches"] = config.num_microbatches
    flat["params_dtype"] = config.model.params_dtype
    flat.update(config.extra)
    return flat


def print_config(config: RunConfig, print_fn: Optional[Callable[[str], None]] = None) -> str:
    """Log the resolved config as Megatron's ``arguments`` block (on rank 0); returns the text."""
    flat = flatten_config(config)
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(flat, key=str.lower):
        value = flat[name]
        if isinstance(value, tuple):
            value = list(value)
        elif not isinstance(value, (int, float, str, list, type(None))):
            value = str(value)
        lines.append(f"  {name} {'.' * (48 - len(name))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    text = "\n".join(lines)
    if global_rank() == 0:
        (print_fn or (lambda s: print(s, flush=True)))(text)
    return text


__all__ = ["ExtraArgsProvider", "build_parser", "field_default", "flatten_config",
           "parse_args", "parse_args_or_exit", "print_config", "unmapped_flags"]
