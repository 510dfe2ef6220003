"""Boxes of global tensors through ``torch.distributed.checkpoint`` (DCP), without gathering.

A torch_dist checkpoint holds named *global* tensors (a layer-stacked weight, the whole
vocabulary) that no rank ever holds whole. Each rank writes the boxes it owns and reads the
boxes it needs::

    Piece("decoder.layers.mlp.linear_fc1.weight", (24, 4096, 1024), (3, 2048, 0), t)

is the box ``t`` (shape ``[1, 2048, 1024]``) at offset ``(3, 2048, 0)`` of that tensor. Small
Python values (random-generator states, Megatron's ``_extra_state``) are byte objects under
their own names. The planners below turn these lists into DCP write and read items; DCP's
``FileSystemWriter`` / ``FileSystemReader`` do the I/O (``__<rank>_<n>.distcp`` files and the
``.metadata`` index that rank 0 writes), and its collectives agree on the plan, so every rank
of ``process_group`` must call ``write_pieces`` / ``read_pieces`` together.

A read clips each box to the stored tensor's extent and leaves the rest of the destination
as it was: the vocabulary of a checkpoint padded for another tensor-parallel size
(Megatron's ``allow_shape_mismatch``). The caller checks that what it needs is stored.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import FileDigest, _ChecksummingWriter, write_error

DCP_METADATA = ".metadata"


@dataclasses.dataclass(frozen=True)
class Piece:
    """The box ``tensor`` of the global tensor ``key`` (``global_shape``) at ``offset``."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor

    def index(self) -> MetadataIndex:
        return MetadataIndex(self.key, torch.Size(self.offset))

    def with_tensor(self, tensor: torch.Tensor) -> Piece:
        return dataclasses.replace(self, tensor=tensor)


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """The elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes
    ``(offset, sizes, first_flat_index)``; each box is a contiguous run of those elements, so
    a flat shard's slice ``[first - lo, first - lo + prod(sizes))`` viewed as ``sizes`` is it.
    At most two partial boxes per dimension and one whole slab."""
    if hi <= lo:
        return []
    if not shape:
        return [((), (), lo)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        base = first * inner
        return [((first, *o), (1, *s), f + base)
                for o, s, f in flat_boxes(shape[1:], lo - base, hi - base)]
    out = []
    if lo % inner:  # the partial row at the start
        out += flat_boxes(shape, lo, (first + 1) * inner)
        first += 1
    whole_end = last if hi % inner else last + 1
    if whole_end > first:
        out.append(((first, *[0] * (len(shape) - 1)), (whole_end - first, *shape[1:]),
                    first * inner))
    if hi % inner:  # the partial row at the end
        out += flat_boxes(shape, last * inner, hi)
    return out


@contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns that it "assumes" one process when torch.distributed is not initialized;
    the converter reads and writes in one process on purpose."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# Writing -------------------------------------------------------------------------------------


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, keeping the size and CRC-32 of every file as it is written
    (so a large checkpoint is not read back to fill the manifest)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, FileDigest] = {}
        self.failed: Optional[tuple[str, OSError]] = None  # the first write that failed

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        writer = None
        try:
            with super().create_stream(path, mode) as stream:
                writer = _ChecksummingWriter(stream)
                yield writer
        except OSError as error:  # the file's own flush or close
            self._failure(str(path), error)
            raise
        finally:
            if writer is not None and writer.error is not None:
                self._failure(str(path), writer.error)
        self.digests[os.path.basename(str(path))] = FileDigest(writer.size, f"{writer.crc:08x}")

    def _failure(self, path: str, error: OSError) -> None:
        if self.failed is None:
            self.failed = (path, error)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        digest = self.digests.pop(os.path.basename(str(path)), None)
        if digest is not None:
            self.digests[os.path.basename(str(new_path))] = digest


class _PieceSavePlanner(DefaultSavePlanner):
    """Writes exactly the given pieces and byte objects of this rank."""

    def __init__(self, pieces: Sequence[Piece], objects: dict[str, bytes]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {p.index(): p for p in pieces}
        if len(self.pieces) != len(pieces):
            raise ValueError("two pieces of one rank share a key and an offset")
        self.objects = objects

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                 for key in self.objects]
        for index, p in self.pieces.items():
            items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=index.offset, sizes=p.tensor.shape),
                    properties=TensorProperties.create_from_tensor(p.tensor),
                    size=torch.Size(p.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.objects[write_item.index.fqn])
        return self.pieces[write_item.index].tensor.detach()


def write_pieces(folder: str, pieces: Sequence[Piece], objects: dict[str, bytes],
                 process_group: Optional[dist.ProcessGroup] = None) -> dict[str, FileDigest]:
    """Write this rank's ``pieces`` and byte ``objects`` into ``folder`` (a collective over
    ``process_group``; rank 0 also writes ``.metadata``). Returns the digests of the files
    this rank wrote, by name. Tensors are written from the host (CPU)."""
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=True,
                                  thread_count=1)
    fs = _DigestingFileSystem()
    writer.fs = fs  # DCP's writer does its file I/O through this attribute
    try:
        with _single_process_quietly():
            dcp.save({}, storage_writer=writer, planner=_PieceSavePlanner(pieces, objects),
                     process_group=process_group, no_dist=not dist.is_initialized())
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        # DCP reports a failed write as torch's writer's own complaint ("unexpected pos");
        # the file and the OSError behind it are the ones recorded as it was written.
        if fs.failed is None and isinstance(error, CheckpointException):
            # Another rank's write failed (DCP gathers failures to every rank): this rank goes
            # on to the save's vote, where the failing rank's own message is the one shown.
            raise CheckpointError(f"torch.distributed.checkpoint's write failed on rank(s) "
                                  f"{sorted(error.failures)}") from error
        if fs.failed is None:
            raise
        path, cause = fs.failed
        needed = sum(p.tensor.nbytes for p in pieces) + sum(len(b) for b in objects.values())
        raise write_error(path, cause, needed) from error
    return dict(fs.digests)


# Reading -------------------------------------------------------------------------------------


def read_metadata(folder: str) -> Metadata:
    """The DCP index (``.metadata``) of a folder: every stored tensor's shape and chunks."""
    return dcp.FileSystemReader(folder).read_metadata()


def stored_shape(metadata: Metadata, key: str) -> Optional[tuple[int, ...]]:
    """The global shape of tensor ``key``, or None when the checkpoint has no such tensor."""
    md = metadata.state_dict_metadata.get(key)
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def _clip(piece: Piece, shape: tuple[int, ...]) -> Optional[tuple[tuple, tuple]]:
    """The part of ``piece``'s box inside a stored tensor of ``shape``: (offset, sizes)."""
    sizes = tuple(min(o + s, g) - o for o, s, g in zip(piece.offset, piece.tensor.shape, shape))
    if any(s <= 0 for s in sizes):
        return None
    return piece.offset, sizes


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Reads the given boxes (in place, into the pieces' tensors) and byte objects."""

    def __init__(self, pieces: Sequence[Piece], object_keys: Sequence[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.targets: dict[tuple, torch.Tensor] = {}
        self.wanted = list(pieces)
        self.object_keys = list(object_keys)
        self.objects: dict[str, bytes] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for p in self.wanted:
            stored = self.metadata.state_dict_metadata[p.key]
            box = _clip(p, tuple(stored.size))
            if box is None:
                continue
            offset, sizes = box
            self.targets[(p.key, offset)] = p.tensor[tuple(slice(0, s) for s in sizes)]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(p.key, stored, [chunk])
        for key in self.object_keys:
            index = MetadataIndex(key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index,
                                  dest_offsets=torch.Size([0]), storage_index=index,
                                  storage_offsets=torch.Size([0]), lengths=torch.Size([0])))
        self.plan = LoadPlan(items)
        return self.plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = value.read()

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[(index.fqn, tuple(index.offset))]


def read_pieces(folder: str, pieces: Sequence[Piece], object_keys: Sequence[str] = (),
                process_group: Optional[dist.ProcessGroup] = None) -> dict[str, bytes]:
    """Fill each piece's tensor with its box of the stored tensor (clipped to the stored
    extent; see the module docstring) and return the byte ``object_keys``; a collective over
    ``process_group``. Every key must exist in the checkpoint (``read_metadata`` tells)."""
    keys = {(p.key, p.offset) for p in pieces}
    if len(keys) != len(pieces):
        raise ValueError("two requested pieces share a key and an offset")
    planner = _PieceLoadPlanner(pieces, object_keys)
    with _single_process_quietly():
        dcp.load({}, storage_reader=dcp.FileSystemReader(folder), planner=planner,
                 process_group=process_group, no_dist=not dist.is_initialized())
    return planner.objects
