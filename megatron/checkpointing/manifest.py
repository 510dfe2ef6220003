"""The manifest: what a complete, intact checkpoint folder is.

Each save writes ``iter_XXXXXXX/manifest.json`` (global rank 0, after every rank has written
its files and before the folder is renamed into place)::

    {
      "manifest_version": 1,
      "iteration": 100,
      "checkpoint_version": 3.0,
      "checksum": "crc32",
      "parallel_layout": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                          "data_parallel_size": 2, "num_model_chunks": 1},
      "files": {"mp_rank_00/model_optim_rng.pt": {"size": 1234567, "crc32": "9c1f02ab"},
                "mp_rank_01/model_optim_rng.pt": {"size": 1234567, "crc32": "03e4d7c0"}},
      "config": {"model": {"num_layers": 24, "hidden_size": 1024, ...}, "parallel": {...}, ...}
    }

``files`` holds every file of the folder except the manifest, by path relative to it, with
its size in bytes and its CRC-32 (zlib's, as 8 hex digits; taken while the bytes stream to
disk, so saving reads nothing back). ``config`` is the resolved run configuration, the same
plain dicts as the ``config`` entry of ``model_optim_rng.pt``, readable without loading a
tensor. Loading checks each file it reads against this record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from megatron.checkpointing.errors import CheckpointCorruptError, CheckpointError
from megatron.checkpointing.files import FileDigest, file_digest, write_text_atomic
from megatron.checkpointing.paths import CHECKPOINT_VERSION, MANIFEST_FILENAME

MANIFEST_VERSION = 1


def build_manifest(iteration: int, parallel_layout: dict, config: Optional[dict],
                   files: Mapping[str, FileDigest]) -> dict:
    """The manifest of a checkpoint folder whose files (relative paths) have ``files``."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "iteration": int(iteration),
        "checkpoint_version": CHECKPOINT_VERSION,
        "checksum": "crc32",
        "parallel_layout": dict(parallel_layout),
        "files": {rel: {"size": d.size, "crc32": d.crc32} for rel, d in sorted(files.items())},
        "config": config,
    }


def write_manifest(folder: str, manifest: dict) -> None:
    # default=str: a config value JSON has no type for (a path object, an enum) is kept as text.
    text = json.dumps(manifest, indent=1, default=str) + "\n"
    write_text_atomic(os.path.join(folder, MANIFEST_FILENAME), text)


def read_manifest(iter_dir: str) -> Optional[dict]:
    """The manifest of a checkpoint folder; None when it has none (saved before manifests,
    or by Megatron-LM / Megatron-DeepSpeed)."""
    path = os.path.join(iter_dir, MANIFEST_FILENAME)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointCorruptError(f"cannot read the checkpoint manifest {path}: {error}; "
                                     "the folder cannot be verified") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(_is_entry(e) for e in files.values()):
        raise CheckpointCorruptError(f"the checkpoint manifest {path} has no valid 'files' "
                                     "table (each entry: size and crc32)")
    if manifest.get("manifest_version", 0) > MANIFEST_VERSION:
        raise CheckpointError(f"{path} has manifest_version {manifest['manifest_version']}; "
                              f"this version reads {MANIFEST_VERSION}: update the code")
    return manifest


def manifest_layout(manifest: dict) -> Optional[tuple[int, int]]:
    """The (tensor, pipeline) sizes the manifest records, if it records them."""
    layout = manifest.get("parallel_layout") or {}
    sizes = (layout.get("tensor_model_parallel_size"), layout.get("pipeline_model_parallel_size"))
    return sizes if all(isinstance(n, int) and n > 0 for n in sizes) else None


def check_complete(iter_dir: str, manifest: dict) -> None:
    """Raise ``CheckpointCorruptError`` naming the files the manifest lists that are missing
    (a folder copied in part, a rank's files deleted): the layout the manifest records is the
    checkpoint's, whatever mp_rank_* folders remain."""
    missing = [rel for rel in manifest["files"]
               if not os.path.isfile(os.path.join(iter_dir, *rel.split("/")))]
    if not missing:
        return
    layout = manifest_layout(manifest)
    saved = (f" of a save with tensor-model-parallel size {layout[0]} and "
             f"pipeline-model-parallel size {layout[1]}" if layout else "")
    shown = ", ".join(f"checkpoint file {os.path.join(iter_dir, *rel.split('/'))} does not "
                      f"exist (listed with {manifest['files'][rel]['size']} bytes)"
                      for rel in missing[:4])
    if len(missing) > 4:
        shown += f", and {len(missing) - 4} more"
    raise CheckpointCorruptError(
        f"checkpoint {iter_dir} is incomplete: {os.path.join(iter_dir, MANIFEST_FILENAME)} lists "
        f"{len(manifest['files'])} files{saved}; {shown}")


def _is_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("size"), int)
            and isinstance(entry.get("crc32"), str))


def verify_files(iter_dir: str, manifest: dict, rel_paths: Iterable[str], *,
                 checksums: bool) -> None:
    """Check that the files ``rel_paths`` of ``iter_dir`` are as the manifest recorded them:
    present, the same size, and (``checksums``) the same CRC-32. Raises
    ``CheckpointCorruptError`` naming the first file that differs and how."""
    recorded = manifest["files"]
    where = os.path.join(iter_dir, MANIFEST_FILENAME)
    for rel in rel_paths:
        check_listed(iter_dir, manifest, rel)
        _verify_file(os.path.join(iter_dir, *rel.split("/")), recorded[rel], where, checksums)


def check_listed(iter_dir: str, manifest: dict, rel: str) -> None:
    """Raise ``CheckpointCorruptError`` when the folder's file ``rel`` is not in the manifest."""
    if rel not in manifest["files"]:
        raise CheckpointCorruptError(
            f"checkpoint file {os.path.join(iter_dir, *rel.split('/'))} is not listed in "
            f"{os.path.join(iter_dir, MANIFEST_FILENAME)}: the folder holds files of another save")


def _verify_file(path: str, entry: dict, where: str, checksum: bool) -> None:
    size = entry["size"]
    if not os.path.isfile(path):
        raise CheckpointCorruptError(f"checkpoint file {path} does not exist ({where} lists "
                                     f"it with {size} bytes)")
    actual_size = os.path.getsize(path)
    if actual_size != size:
        how = "truncated" if actual_size < size else "longer than it was written"
        raise CheckpointCorruptError(f"checkpoint file {path} is damaged: it has "
                                     f"{actual_size} bytes, {where} recorded {size} ({how})")
    if not checksum:
        return
    actual = file_digest(path).crc32
    if actual != entry["crc32"]:
        raise CheckpointCorruptError(f"checkpoint file {path} is damaged: its CRC-32 is "
                                     f"{actual}, {where} recorded {entry['crc32']} (same size, "
                                     f"{size} bytes: its contents changed after it was saved)")
