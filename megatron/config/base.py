"""The pieces every configuration slice is made of.

A slice is a frozen dataclass. Each field that a user sets is declared once with ``option``:
its flag spellings (the first is the canonical one, the others are aliases users already have
in their scripts), its help text and, where argparse needs them, choices, nargs or an action.
The dataclass default is the one default; the command-line parser and the TOML reader are
both generated from these declarations (``megatron.config.cli``).

Two other kinds of field carry no flag:

- ``received("slice.field")``: a value another slice owns and this one needs (the model needs
  the tensor-parallel size). ``RunConfig`` copies it from its owner; it is never set by a user.
- ``internal(why)``: a value that comes from the run itself (the world size from the launcher,
  the vocabulary size from the tokenizer).

Each slice validates its own fields in ``__post_init__`` and raises ``ConfigError`` naming the
flag; rules between slices live in ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any, Optional


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent with another one."""


def flag(field_name: str) -> str:
    """The command-line spelling of a config field: ``hidden_size`` -> ``--hidden-size``."""
    return "--" + field_name.replace("_", "-")


# ----------------------------------------------------------------------------- declarations

_MISSING = dataclasses.MISSING


def option(*flags: str, help: str, default: Any = _MISSING, default_factory: Any = _MISSING,
           action: Optional[str] = None, choices: Optional[tuple] = None,
           nargs: Optional[Any] = None, metavar: Any = None, const: Any = None,
           required: bool = False, cli_default: Any = _MISSING,
           refused: Optional[str] = None, feeds: tuple[str, ...] = (),
           settings_source: bool = False) -> Any:
    """A field set by the flags ``flags`` (no flags: ``--field-name``).

    required: the command line must give it (the dataclass default serves programmatic use).
    cli_default: the value the command line starts from when it differs from the dataclass
    default (only where a Megatron flag's default differs from a useful programmatic one).
    refused: the flag is kept so that users' scripts get a clear answer, but the capability
    does not exist yet; giving any other value than the default is an error with this text.
    feeds: what the config package derives from this value (``virtual_pipeline_model_parallel
    _size``); the accepted-means-used test follows it there.
    settings_source: the flag names a place the config package itself reads settings from
    (``--use-checkpoint-args``), so its one reader is in this package.
    """
    metadata = {"flags": flags, "help": help, "action": action, "choices": choices,
                "nargs": nargs, "metavar": metavar, "const": const, "required": required,
                "cli_default": cli_default, "refused": refused, "feeds": feeds,
                "settings_source": settings_source}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def received(source: str, default: Any) -> Any:
    """A field owned by another slice (``"parallel.tensor_model_parallel_size"``)."""
    return dataclasses.field(default=default, metadata={"received": source})


def internal(why: str, default: Any) -> Any:
    """A field that no user sets: it comes from the run (``why`` says from where)."""
    return dataclasses.field(default=default, metadata={"internal": why})


def check_refused(obj: Any) -> None:
    """Refuse a slice whose refused flags (capabilities not built yet) were given."""
    for f in option_fields(obj):
        reason = f.metadata.get("refused")
        value = getattr(obj, f.name)
        if reason and value != field_default(f):
            given = flags_of(f)[0] if isinstance(value, bool) else f"{flags_of(f)[0]} {value}"
            raise ConfigError(f"{given}: {reason}")


def is_option(f: dataclasses.Field) -> bool:
    return "flags" in f.metadata


def option_fields(cls_or_obj: Any) -> Iterator[dataclasses.Field]:
    """The user-settable fields of a slice, in declaration order."""
    return (f for f in dataclasses.fields(cls_or_obj) if is_option(f))


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or (flag(f.name),)


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def cli_default(f: dataclasses.Field) -> Any:
    """Where the command line starts: None for required flags, else the one default."""
    if f.metadata.get("required"):
        return None
    if f.metadata.get("cli_default", _MISSING) is not _MISSING:
        return f.metadata["cli_default"]
    return field_default(f)


def value_type(cls: type, f: dataclasses.Field) -> type:
    """The scalar type of a field: ``Optional[int]`` -> int, ``tuple[str, ...]`` -> str."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return args[0]
    if args and origin is not None:  # Optional[X] / Union[X, None]
        inner = args[0]
        if typing.get_origin(inner) in (tuple, list):
            return typing.get_args(inner)[0]
        return inner
    return hint


# ----------------------------------------------------------------------------- checks


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is not None and value > 0, f"{flag(name)} must be positive, got {value}")


def optional_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value > 0, f"{flag(name)} must be positive, got {value}")


def non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value >= 0, f"{flag(name)} must be non-negative, got {value}")


def probability(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")


def one_of(obj: Any, name: str, allowed: tuple) -> None:
    value = getattr(obj, name)
    require(value in allowed, f"{flag(name)} must be one of "
            f"{', '.join(str(a) for a in allowed if a is not None)}, got {value!r}")


def as_tuples(obj: Any, *names: str) -> None:
    """Lists (argparse, TOML) become tuples, so a frozen slice stays immutable and hashable."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, list):
            object.__setattr__(obj, name, tuple(value))


def set_field(obj: Any, name: str, value: Any) -> None:
    """Resolve a derived value inside ``__post_init__`` of a frozen slice."""
    object.__setattr__(obj, name, value)


class Slice:
    """What every slice can do besides holding fields."""

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def settings(self) -> dict:
        """The user-settable values (what ``--dump-config`` writes for this slice); refused
        flags can only hold their default and are left out."""
        return {f.name: getattr(self, f.name) for f in option_fields(self)
                if not f.metadata.get("refused")}


def precision_dtype(fp16: bool, bf16: bool) -> Any:
    """The torch dtype the --fp16/--bf16 switches select (fp32 when neither is given)."""
    import torch  # a leaf import: the config package itself does not need torch

    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32


def to_dict(config: Any) -> dict:
    """Every field of a slice as plain values (dtypes by name), for checkpoints and logs."""
    import torch  # a leaf import: the config package itself does not need torch

    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[f.name] = value
    return out
