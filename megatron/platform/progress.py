"""How far a long job is and when it should end, in the words of every progress line
(preprocessing, zero-shot evaluation): ``42.0% done, ETA 0:01:23``. No torch import: the
preprocessing workers use it."""

from __future__ import annotations

import datetime


def percent_and_eta(fraction: float, seconds: float) -> str:
    """``"42.0% done, ETA 0:01:23"`` for ``fraction`` (0 to 1) of the work done in
    ``seconds``, the rest assumed to go at the same pace."""
    fraction = min(max(fraction, 0.0), 1.0)
    eta = seconds * (1.0 - fraction) / fraction if fraction > 0.0 else float("nan")
    eta_text = str(datetime.timedelta(seconds=round(eta))) if eta == eta else "unknown"
    return f"{100.0 * fraction:.1f}% done, ETA {eta_text}"
