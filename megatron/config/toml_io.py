"""Run configurations as TOML files: one table per slice (``[model]``, ``[parallel]``, ...),
keys named as the fields (``hidden_size``, the flag ``--hidden-size`` without dashes).

Reading checks every table, key and value type against the slices' declarations and names the
file, table and key of anything wrong. Writing gives back exactly what was read.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from megatron.config.base import ConfigError, option_fields, value_type
from megatron.config.run import SLICE_CLASSES, RunConfig
from megatron.platform.file_modes import chmod_as_created

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def read_toml(path: str) -> dict:
    """The parsed file; malformed TOML names the file and line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a folder, not a TOML file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path}: not valid TOML: {error}") from None


def toml_settings(path: str, extra_dests: Mapping[str, Any]) -> dict[str, Any]:
    """Field name -> value for every key of the file, checked against the slices.

    extra_dests: the extra argument provider's flags (``[extra]`` table), name -> default.
    """
    document = read_toml(path)
    values: dict[str, Any] = {}
    tables = list(SLICE_CLASSES) + (["extra"] if extra_dests else [])
    for table, content in document.items():
        if not isinstance(content, dict):
            raise _top_level_key_error(path, table, tables)
        if table not in tables:
            raise ConfigError(f"{path}: unknown table [{table}]{_hint(table, tables)}; tables "
                              f"are {', '.join(f'[{t}]' for t in tables)}")
        if table == "extra":
            values.update(_extra_values(path, content, extra_dests))
            continue
        fields = {f.name: f for f in option_fields(SLICE_CLASSES[table])}
        for key, value in content.items():
            if key not in fields:
                raise ConfigError(f"{path}: unknown key {key!r} in [{table}]"
                                  f"{_elsewhere(key) or _hint(key, list(fields))}")
            values[key] = _checked(path, table, SLICE_CLASSES[table], fields[key], value)
    return values


def _top_level_key_error(path: str, key: str, tables: list[str]) -> ConfigError:
    """A ``key = value`` before the first table header: every key belongs in a table."""
    line = _top_level_line(path, key)
    where = f"{path}, line {line}" if line else path
    hint = _elsewhere(key) or (f" (it is the name of the table [{key}])" if key in tables
                               else _hint(key, _all_keys()))
    return ConfigError(f"{where}: key {key!r} is outside any table{hint}; every key goes in "
                       f"one of {', '.join(f'[{t}]' for t in tables)}")


def _top_level_line(path: str, key: str) -> Optional[int]:
    """The line of ``key = ...`` above the first table header, if it can be found."""
    pattern = re.compile(rf"""\s*(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')\s*=""")
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if text.lstrip().startswith("["):
                return None
            if pattern.match(text):
                return number
    return None


def _all_keys() -> list[str]:
    return [f.name for cls in SLICE_CLASSES.values() for f in option_fields(cls)]


def _elsewhere(key: str) -> str:
    for table, cls in SLICE_CLASSES.items():
        if any(f.name == key for f in option_fields(cls)):
            return f" (it belongs in [{table}])"
    return ""


def _hint(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_error(path: str, table: str, key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{path}: [{table}] {key} must be {expected}, got {value!r}")


def _checked(path: str, table: str, cls: type, f: dataclasses.Field, value: Any) -> Any:
    kind = value_type(cls, f)
    nargs = f.metadata.get("nargs")
    if nargs is not None:
        if not isinstance(value, list):
            raise _type_error(path, table, f.name, "a list", value)
        if isinstance(nargs, int) and len(value) != nargs:
            raise _type_error(path, table, f.name, f"a list of {nargs}", value)
        return [_scalar(path, table, f, kind, item, in_list=True) for item in value]
    return _scalar(path, table, f, kind, value)


def _scalar(path: str, table: str, f: dataclasses.Field, kind: type, value: Any,
            in_list: bool = False) -> Any:
    if kind is str and in_list and isinstance(value, (int, float)) \
            and not isinstance(value, bool):
        return str(value)  # blend weights in a path list: [0.3, "wiki", 0.7, "owt"]
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}.get(kind, True)
    if not ok:
        raise _type_error(path, table, f.name, _TYPE_NAMES.get(kind, str(kind)), value)
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise _type_error(path, table, f.name, "one of " + ", ".join(map(str, choices)), value)
    return float(value) if kind is float else value


def _extra_values(path: str, content: dict, extra_dests: Mapping[str, Any]) -> dict:
    for key in content:
        if key not in extra_dests:
            raise ConfigError(f"{path}: unknown key {key!r} in [extra]"
                              f"{_hint(key, list(extra_dests))}")
    return dict(content)


def config_to_toml(config: RunConfig) -> str:
    """The effective configuration as TOML (unset values are left out: they are the
    defaults)."""
    import tomli_w  # only --dump-config writes TOML; machines without it can still train

    document = {}
    for table, settings in config.settings().items():
        entries = {k: list(v) if isinstance(v, tuple) else v
                   for k, v in settings.items() if v is not None}
        if entries:
            document[table] = entries
    header = ("# Effective configuration written by --dump-config; read it back with "
              "--config FILE.\n")
    return header + tomli_w.dumps(document)


def dump_config(config: RunConfig, path: str) -> None:
    """Write ``config`` to ``path`` as TOML, atomically (a reader never sees half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--dump-config {path}: folder {folder} does not exist")
    text = config_to_toml(config)
    fd, tmp = tempfile.mkstemp(prefix=".dump-config-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        chmod_as_created(tmp)  # mkstemp's 0600 would become the file's mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
