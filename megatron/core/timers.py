"""Named wall-clock timers, with log levels as Megatron's ``--timing-log-level`` and its
``--timing-log-option`` (max, minmax, all) for reporting them across ranks."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron.config.logs import TIMING_LOG_OPTIONS
from megatron.core import parallel_state

_HEADERS = {"max": "max time across ranks (ms)", "minmax": "(min, max) time across ranks (ms)",
            "all": "time on each rank (ms)"}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Timer:
    def __init__(self) -> None:
        self.elapsed_s = 0.0
        self._start = None

    def start(self) -> None:
        _sync()
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            return
        _sync()
        self.elapsed_s += time.perf_counter() - self._start
        self._start = None

    def pop(self) -> float:
        """Elapsed seconds since the last pop (a running timer keeps running)."""
        running = self._start is not None
        if running:
            self.stop()
        value, self.elapsed_s = self.elapsed_s, 0.0
        if running:
            self.start()
        return value


class _NullTimer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class Timers:
    """``timers("forward-backward", log_level=1).start()``; timers above ``log_level`` are free."""

    def __init__(self, log_level: int = 0) -> None:
        self.log_level = log_level
        self.timers: dict[str, _Timer] = {}
        self._null = _NullTimer()

    def __call__(self, name: str, log_level: int = 0):
        if log_level > self.log_level:
            return self._null
        return self.timers.setdefault(name, _Timer())

    def pop_all(self) -> dict[str, float]:
        """Seconds per timer since the last call, and reset them."""
        return {name: t.pop() for name, t in self.timers.items()}


def gather_across_ranks(seconds: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's ``pop_all`` result, in rank order (a collective: call it on all ranks)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [seconds]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seconds, group=parallel_state.get_control_group())
    return gathered


def format_across_ranks(per_rank: list[dict[str, float]], option: str,
                        normalizer: float = 1.0) -> str:
    """One log line of the timers of all ranks: their max, their (min, max), or every rank's
    value ("-" where a rank has no such timer, e.g. a pipeline stage that does not run it)."""
    if option not in TIMING_LOG_OPTIONS:
        raise ValueError(f"timing log option must be one of {TIMING_LOG_OPTIONS}, got {option!r}")
    names = list(dict.fromkeys(name for timings in per_rank for name in timings))

    def ms(value: float) -> str:
        return f"{1000.0 * value / normalizer:.2f}"

    parts = []
    for name in names:
        values = [timings[name] for timings in per_rank if name in timings]
        if option == "max":
            text = ms(max(values))
        elif option == "minmax":
            text = f"({ms(min(values))}, {ms(max(values))})"
        else:
            text = "(" + ", ".join(ms(t[name]) if name in t else "-" for t in per_rank) + ")"
        parts.append(f"{name}: {text}")
    return f"{_HEADERS[option]} | " + " | ".join(parts)
