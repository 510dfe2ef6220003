"""What a checkpoint format is to the rest of the project (``Format``), and the registry that
finds one by name or by what a folder holds.

Save, load, generation, evaluation and conversion reach a format only through this
protocol: ``format_named(--ckpt-format)`` for a save, ``folder.format`` (told by
``folder.format_of`` from the folder's files) for everything else. Each format is one
subpackage of ``checkpointing/formats/`` that registers itself at import; adding one is that
subpackage plus its line in ``formats/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Protocol

import torch

from megatron.checkpointing.errors import CheckpointError

# The types below name folder.CheckpointFolder and folder.Naming, full_state.FullCheckpoint and
# loaded.LoadedCheckpoint by name only: those modules sit above this one (folder.py finds
# formats here).
CheckpointFolder = Naming = FullCheckpoint = LoadedCheckpoint = Any


class SaveRequest(NamedTuple):
    """Everything one rank's save of one iteration takes (``save.save_checkpoint``'s call)."""

    iteration: int
    chunks: list  # this rank's model chunks
    optimizer: Any
    scheduler: Any
    config: Any  # the RunConfig
    layout: Any  # ranks.RankLayout
    rng_states: Optional[list[dict]]  # one per data-parallel rank; None with --no-save-rng
    consumed: tuple[int, int]  # consumed train and valid samples
    extra: Optional[dict]  # further top-level entries (e.g. the FLOP count)
    valid_loss: Optional[float]  # for --save-best
    saver: Any = None  # async_save.AsyncSaver for a background save
    refuse_nonfinite: bool = False  # fail, naming the tensor, on NaN/Inf in what is written


class LoadRequest(NamedTuple):
    """Everything one rank's load of a folder takes (``load.load_checkpoint``'s call)."""

    chunks: list
    optimizer: Any
    scheduler: Any
    config: Any
    layout: Any
    model_only: bool  # --finetune or a release folder: weights only, counters from 0
    load_optim: bool  # optimizer and scheduler wanted
    strict: bool = True  # every parameter of the model must be in the checkpoint


class Format(Protocol):
    """One checkpoint format. ``name`` is ``--ckpt-format``'s spelling; ``naming`` how its
    roots name their folders and tracker (``folder.MEGATRON`` or ``folder.DEEPSPEED``);
    ``fallback``: the format of a folder of that naming that no other format recognises (its
    loader then names what is missing)."""

    name: str
    naming: Naming
    fallback: bool

    def recognise(self, iter_dir: str) -> bool:
        """Whether an iteration folder's files are this format's."""

    def layout(self, iter_dir: str) -> tuple[int, int]:
        """The (tensor, pipeline) sizes the folder was saved with."""

    def stored_config(self, iter_dir: str) -> Optional[dict]:
        """Its run configuration (plain dicts, ours or translated), read without weights."""

    def common(self, iter_dir: str) -> dict:
        """The top-level entries every rank shares (schedule, counters), without weights."""

    def start_save(self, request: SaveRequest) -> Any:
        """Take this rank's state for a save; returns the job (``async_save.SaveJob``) that
        writes and publishes it. CheckpointError for a format our training does not write."""

    def plan_save(self, request: SaveRequest,
                  record: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take the state as ``start_save`` does, passing each tensor a background save would
        copy to host memory through ``record`` (--async-save reserves its buffers so)."""

    def load(self, folder: CheckpointFolder, request: LoadRequest) -> LoadedCheckpoint:
        """Load ``folder`` into this rank's model (and optimizer, scheduler, generators)."""

    def read_whole(self, folder: CheckpointFolder, *, verify: bool,
                   true_vocab_size: Optional[int], optimizer: bool) -> FullCheckpoint:
        """The whole checkpoint at tensor/pipeline size 1 (conversion, generation)."""

    def loads_at(self, folder: CheckpointFolder, parallel: Any) -> bool:
        """Whether each rank of a run with this ParallelConfig reads its own part of
        ``folder`` directly (else the whole model is read and cut for it)."""


_FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> None:
    """Make ``fmt`` known to ``format_named`` and ``folder.format_of`` (each format's package
    calls this at import)."""
    _FORMATS[fmt.name] = fmt


def registered_formats() -> list[Format]:
    return list(_FORMATS.values())


def format_named(name: str) -> Format:
    """The format called ``name`` (``--ckpt-format``)."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise CheckpointError(f"unknown checkpoint format {name!r} (known: "
                              f"{', '.join(sorted(_FORMATS))})") from None
