#!/usr/bin/env python
"""Rehearse a launch on this machine before paying for it (megatron/rehearsal):

    python tools/rehearse.py --world-size 64 [pretrain_gpt.py flags] \\
        --rehearse-hidden-size 96 --rehearse-seq-length 8

the same as ``WORLD_SIZE=64 python pretrain_gpt.py [flags] --rehearse``. Every rank of the
launch (or the first and last rank of each pipeline stage, --rehearse-ranks classes) runs its
set-up and one training iteration over PyTorch's fake process group; the ranks' collectives
and point-to-point operations are matched, and the fullest and emptiest rank's parameters,
memory and communication per iteration printed. Exit status 0 when the communication fits
together, 1 when not, 2 on bad flags.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))


def _world_size(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """--world-size N (or --world-size=N) taken out of argv."""
    for i, arg in enumerate(argv):
        if arg == "--world-size" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith("--world-size="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        raise SystemExit(0)
    world, rest = _world_size(argv)
    if world is not None:
        if not world.isdigit() or int(world) < 1:
            print(f"error: --world-size must be a positive integer, got {world!r}",
                  file=sys.stderr)
            raise SystemExit(2)
        os.environ["WORLD_SIZE"] = world
    # lazy: keeps `tools/rehearse.py --help` from importing torch (0.1 s, against 2.2 s)
    import pretrain_gpt

    pretrain_gpt.main([*rest, "--rehearse"] if "--rehearse" not in rest else rest)


if __name__ == "__main__":
    main()
