"""Named wall-clock timers, with log levels as Megatron's ``--timing-log-level``."""

from __future__ import annotations

import time

import torch


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

    def format(self, seconds: dict[str, float], normalizer: float = 1.0) -> str:
        parts = [f"{name}: {1000.0 * s / normalizer:.2f}" for name, s in seconds.items()]
        return "time (ms) | " + " | ".join(parts)
