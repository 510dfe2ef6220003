"""The checkpoint folder: the one module that knows how checkpoints lie on disk in each
format, which iteration folder is the latest complete one, and how a finished folder is put
into place. Training, conversion, generation, evaluation and the DeepSpeed adapter find and
publish checkpoints through it.

A checkpoint *root* (the ``--save`` / ``--load`` folder) holds one folder per saved iteration
and a tracker file that names the latest. Two namings exist (``Naming``)::

    MEGATRON (formats torch, torch_dist)       DEEPSPEED (format deepspeed)
    latest_checkpointed_iteration.txt  "100"   latest  "global_step100"
    iter_0000100/   (or release/)              global_step100/

What an iteration folder holds tells its *format* (``format.Format``; each is a subpackage of
``formats/`` that registers itself)::

    torch       mp_rank_TT[_PPP]/model_optim_rng.pt (+ distrib_optim.pt): Megatron's layout,
                written by formats/torch
    torch_dist  .metadata, __R_I.distcp, common.pt, metadata.json: Megatron-LM's
                dist_checkpointing
    deepspeed   mp_rank_XX_model_states.pt, zero_pp_rank_*, layer_*: DeepSpeed's engine

Every folder we write also holds ``manifest.json`` (manifest.py: each file's size and CRC-32,
the layout and the run's config). A folder is *complete* when its manifest is there and every
file it lists exists with the recorded size. The latest checkpoint is the tracker's folder;
when the tracker is missing or empty, or names a folder that is gone or incomplete, it is the
newest complete folder instead, and a warning says so (the tracker is written last, so a
crash or a full disk after the folder was published leaves it behind).

A root's kind is told here too (``namings_in``: by its tracker files, else by its folders);
``find_checkpoint`` is the latest checkpoint of a root of either naming, for the tools that
take any checkpoint (generation, evaluation, ``--use-checkpoint-args``).

Interface::

    folder = latest_checkpoint(root)          # or checkpoint_at(root, iteration); None: none
    folder = find_checkpoint(root)            # either naming (DeepSpeed's too); None: none
    folder.path, folder.iteration, folder.release, folder.format.name, folder.manifest
    folder.layout()            # (tensor, pipeline) sizes it was saved with
    folder.config()            # the run configuration stored with it (plain dicts)
    folder.format.common(folder.path)   # the entries every rank shares (schedule, counters)
    folder.rank_file(t, p)     # torch format: mp_rank_TT[_PPP]/model_optim_rng.pt
    folder.verify(rel_paths, checksums=True)
    publish_checkpoint(root, tmp_dir, iteration, manifest)   # rank 0, after every rank wrote
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import NamedTuple, Optional

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import (
    FileDigest,
    file_digest,
    fsync_dir,
    write_text_atomic,
)
from megatron.checkpointing.format import Format, registered_formats
from megatron.checkpointing.manifest import (
    manifest_layout,
    read_manifest,
    verify_files,
    write_manifest,
)
from megatron.checkpointing.paths import (
    MANIFEST_FILENAME,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    mp_rank_dir_name,
)
from megatron.platform.file_modes import chmod_as_created

logger = logging.getLogger(__name__)

DEEPSPEED_TRACKER_FILENAME = "latest"


# Namings: the tracker file and the iteration folders' names --------------------------------


class Tracker(NamedTuple):
    """What a tracker file says: an iteration, or the release folder."""

    iteration: int
    release: bool


@dataclasses.dataclass(frozen=True)
class Naming:
    """How a root names its iteration folders and its tracker file."""

    tracker: str  # the file in the root naming the latest folder
    prefix: str  # folder name = prefix + iteration, zero-padded to ``digits``
    digits: int
    # The tracker holds the folder's name (DeepSpeed's tag), not the iteration number.
    tracker_names_folder: bool = False
    release: Optional[str] = None  # the folder of a release (model-only) checkpoint

    def folder_name(self, iteration: int, release: bool = False) -> str:
        if release:
            if self.release is None:
                raise ValueError(f"{self.tracker} names no release folder")
            return self.release
        return f"{self.prefix}{iteration:0{self.digits}d}"

    def iteration_of(self, name: str) -> Optional[int]:
        """The iteration a folder name stands for; None for any other name."""
        m = re.fullmatch(re.escape(self.prefix) + rf"(\d{{{self.digits},}})", name)
        return int(m.group(1)) if m else None

    def tracker_text(self, iteration: int, release: bool = False) -> str:
        if self.tracker_names_folder:
            return self.folder_name(iteration, release)
        return "release" if release else str(iteration)

    def parse_tracker(self, text: str, path: str) -> Tracker:
        """What a tracker's text names; CheckpointError when it names no folder."""
        if self.release is not None and text == "release":
            return Tracker(0, True)
        if self.tracker_names_folder:
            iteration = self.iteration_of(text)
            expected = f"a folder name {self.prefix}N"
        else:
            iteration = int(text) if re.fullmatch(r"\d+", text) else None
            expected = "an iteration number or 'release'"
        if iteration is None:
            raise CheckpointError(f"{path}: expected {expected}, got {text[:80]!r}")
        return Tracker(iteration, False)


MEGATRON = Naming(TRACKER_FILENAME, "iter_", 7, release="release")
DEEPSPEED = Naming(DEEPSPEED_TRACKER_FILENAME, "global_step", 1, tracker_names_folder=True)


# Formats: what an iteration folder holds ---------------------------------------------------


def format_of(iter_dir: str, naming: Naming = MEGATRON) -> Format:
    """The format of the folder ``iter_dir``, told by its files (torch when nothing tells:
    its loader then names what is missing)."""
    candidates = [f for f in registered_formats() if f.naming is naming]
    if os.path.isdir(iter_dir):
        for fmt in candidates:
            if not fmt.fallback and fmt.recognise(iter_dir):
                return fmt
    return next((f for f in candidates if f.fallback), candidates[0])


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    """Megatron's folder name of ``iteration`` (iter_0000100), or of a release."""
    return MEGATRON.folder_name(iteration, release)


def checkpoint_path(save_dir: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    *, release: bool = False) -> str:
    """The ``model_optim_rng.pt`` of one (tensor, pipeline) rank (torch format)."""
    return os.path.join(save_dir, iteration_dir_name(iteration, release),
                        mp_rank_dir_name(tp_rank, pp_rank, pp_size), MODEL_FILENAME)


# One iteration folder ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointFolder:
    """One saved iteration: ``path`` inside the root ``root``."""

    root: str
    path: str
    iteration: int
    release: bool = False
    naming: Naming = MEGATRON

    @functools.cached_property
    def format(self) -> Format:
        return format_of(self.path, self.naming)

    @functools.cached_property
    def manifest(self) -> Optional[dict]:
        """Its manifest.json; None when it has none (saved before manifests, or elsewhere)."""
        return read_manifest(self.path)

    def layout(self) -> tuple[int, int]:
        """(tensor, pipeline) sizes it was saved with: as its manifest records them (a folder
        that lost a rank's files keeps its layout), else as its format tells from its files."""
        recorded = manifest_layout(self.manifest) if self.manifest is not None else None
        return recorded or self.format.layout(self.path)

    def num_model_chunks(self) -> int:
        """Model chunks (virtual-pipeline stages) per rank file, as the manifest records."""
        return int(((self.manifest or {}).get("parallel_layout") or {})
                   .get("num_model_chunks", 1))

    def config(self) -> Optional[dict]:
        """The run configuration saved with it: the manifest's, else what its files store
        (Megatron's: their argparse fields, flat); None when it stores none."""
        if self.manifest is not None and self.manifest.get("config") is not None:
            return self.manifest["config"]
        return self.format.stored_config(self.path)

    def rank_dir(self, tp_rank: int, pp_rank: int, pp_size: int) -> str:
        return os.path.join(self.path, mp_rank_dir_name(tp_rank, pp_rank, pp_size))

    def rank_file(self, tp_rank: int, pp_rank: int, pp_size: int,
                  name: str = MODEL_FILENAME) -> str:
        """A (tensor, pipeline) rank's file (torch format): model_optim_rng.pt by default,
        ``DISTRIB_OPTIM_FILENAME`` for the distributed optimizer's."""
        return os.path.join(self.rank_dir(tp_rank, pp_rank, pp_size), name)

    def verify(self, rel_paths: Optional[list[str]] = None, *, checksums: bool = True) -> None:
        """Check files (paths relative to the folder; default: all) against the manifest.
        Raises ``CheckpointCorruptError`` naming the first that differs; does nothing for a
        folder without a manifest."""
        if self.manifest is None:
            return
        verify_files(self.path, self.manifest,
                     list(self.manifest["files"]) if rel_paths is None else rel_paths,
                     checksums=checksums)

    def incomplete_because(self, require_manifest: bool = True) -> Optional[str]:
        """Why the folder is not a complete checkpoint (gone; no manifest, unless not
        ``require_manifest``; a file missing or of another size than recorded); None when it
        is complete. Sizes only: no checksums."""
        if not os.path.isdir(self.path):
            return f"{self.path} does not exist"
        try:
            if self.manifest is None:
                return f"it has no {MANIFEST_FILENAME}" if require_manifest else None
            self.verify(checksums=False)
        except CheckpointError as error:
            return str(error)
        return None


# Finding the latest ------------------------------------------------------------------------


def list_iterations(root: str, naming: Naming = MEGATRON) -> list[int]:
    """Iterations that have a (renamed, not temporary) folder in ``root``, sorted."""
    if not os.path.isdir(root):
        return []
    found = ((naming.iteration_of(name), name) for name in os.listdir(root))
    return sorted(it for it, name in found
                  if it is not None and os.path.isdir(os.path.join(root, name)))


def read_tracker(root: str, naming: Naming = MEGATRON) -> Optional[Tracker]:
    """What the tracker file of ``root`` names, as written; None when there is none or it is
    empty. (``latest_checkpoint`` is what to load: it also checks the folder.)"""
    path = os.path.join(root, naming.tracker)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    return naming.parse_tracker(text, path) if text else None


def checkpoint_at(root: str, iteration: int, release: bool = False,
                  naming: Naming = MEGATRON, *, warn: bool = True) -> CheckpointFolder:
    """The folder of ``iteration`` (or the release folder), which must exist; after a crash
    in the middle of replacing a checkpoint of the same iteration, the older copy that was
    being replaced (``warn``: say so)."""
    final = os.path.join(root, naming.folder_name(iteration, release))
    folder = CheckpointFolder(root, final, iteration, release, naming)
    if os.path.isdir(final):
        return folder
    backups = sorted(glob.glob(glob.escape(final) + ".old-*"), key=os.path.getmtime)
    if backups:
        (logger.warning if warn else logger.debug)("%s is missing; loading %s (a save of the same iteration was "
                       "interrupted)", final, backups[-1])
        return dataclasses.replace(folder, path=backups[-1])
    raise CheckpointError(f"{os.path.join(root, naming.tracker)} names "
                          f"{os.path.basename(final)}, but {final} does not exist")


def newest_complete(root: str, naming: Naming = MEGATRON,
                    skip: Optional[int] = None) -> Optional[CheckpointFolder]:
    """The newest iteration folder of ``root`` that is complete (its manifest verifies, by
    sizes), other than iteration ``skip``; None when there is none."""
    for it in reversed(list_iterations(root, naming)):
        if it == skip:
            continue
        folder = CheckpointFolder(root, os.path.join(root, naming.folder_name(it)), it,
                                  naming=naming)
        if folder.incomplete_because() is None:
            return folder
    return None


def latest_checkpoint(root: str, naming: Naming = MEGATRON, *,
                      warn: bool = True) -> Optional[CheckpointFolder]:
    """The checkpoint to resume from in ``root``: the tracker's folder, or (when the tracker
    is missing or empty, or names a folder that is gone or incomplete) the newest complete
    folder, with a warning that says why (``warn=False``: a look ahead of the load, which
    warns itself). None when ``root`` holds no checkpoint.

    A folder without a manifest (saved before manifests, or by Megatron-LM) is taken when the
    tracker names it: it cannot be checked. When the tracker names an incomplete folder and
    no other is complete, that folder is returned (loading it names what is wrong). Raises
    ``CheckpointError`` when the tracker names a folder that does not exist and no other is
    complete, and for a tracker whose text names no folder.
    """
    if not os.path.isdir(root):
        return None
    path = os.path.join(root, naming.tracker)
    tracker = read_tracker(root, naming)
    if tracker is None:
        why = f"{path} is missing" if not os.path.isfile(path) else f"{path} is empty"
        return _newest_instead(root, naming, None, why, warn)
    try:
        folder = checkpoint_at(root, tracker.iteration, tracker.release, naming, warn=warn)
    except CheckpointError:
        name = naming.folder_name(tracker.iteration, tracker.release)
        instead = _newest_instead(root, naming, tracker.iteration,
                                  f"{path} names {name}, which does not exist", warn)
        if instead is None:
            raise
        return instead
    why = folder.incomplete_because(require_manifest=False)
    if why is not None:
        return _newest_instead(root, naming, tracker.iteration,
                               f"{path} names {folder.path}, which is incomplete ({why})",
                               warn) or folder
    return folder


def _newest_instead(root: str, naming: Naming, skip: Optional[int], why: str,
                    warn: bool = True) -> Optional[CheckpointFolder]:
    """The newest complete folder in place of the tracker's (``why``: what is wrong with
    it), with a warning; None when there is none."""
    say = logger.warning if warn else logger.debug
    folder = newest_complete(root, naming, skip)
    if folder is not None:
        say("%s; loading %s instead, the newest complete checkpoint there", why,
                       folder.path)
        return folder
    others = [it for it in list_iterations(root, naming) if it != skip]
    if others:
        say("%s, and no other folder of %s (%s) is a complete checkpoint (a %s "
                       "whose files are all there)", why, root,
                       ", ".join(naming.folder_name(it) for it in others[-5:]),
                       MANIFEST_FILENAME)
    return None


# Any checkpoint root ------------------------------------------------------------------------


def namings_in(root: str) -> list[Naming]:
    """The namings of the checkpoints ``root`` holds, told by their tracker files, else by
    their iteration folders: ``[MEGATRON]`` (ours, Megatron-LM's, Megatron-DeepSpeed's),
    ``[DEEPSPEED]`` (DeepSpeed's engines), both, or none."""
    if not os.path.isdir(root):
        return []
    namings = (MEGATRON, DEEPSPEED)
    found = [n for n in namings if os.path.isfile(os.path.join(root, n.tracker))]
    return found or [n for n in namings if list_iterations(root, n)]


def find_checkpoint(root: str) -> Optional[CheckpointFolder]:
    """The latest checkpoint of ``root`` whatever its kind (``latest_checkpoint`` in the
    naming ``namings_in`` finds; ours first when both are there, as --load without
    --deepspeed reads it): for the tools that take any checkpoint (generation, evaluation,
    --use-checkpoint-args). None when it holds none."""
    namings = namings_in(root)
    return latest_checkpoint(root, namings[0]) if namings else None


def no_checkpoint_error(root: str, flag: str = "--load",
                        namings: tuple[Naming, ...] = (MEGATRON, DEEPSPEED)) -> CheckpointError:
    """The error for a ``flag`` folder without a checkpoint of any of ``namings``."""
    trackers = [f"no {MEGATRON.tracker}" if n is MEGATRON else f"DeepSpeed's '{n.tracker}' file"
                for n in namings]
    return CheckpointError(f"{flag} {root} holds no checkpoint ({', nor '.join(trackers)})")


# --load, checked before anything is built -----------------------------------------------


# Writing -----------------------------------------------------------------------------------


def make_tmp_folder(root: str, name: str) -> str:
    """A fresh temporary folder ``root/<name>.tmp-XXXX`` (root created if needed) with the
    mode a plain mkdir gives, for a save to fill and ``publish_checkpoint`` to rename."""
    os.makedirs(root, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f"{name}.tmp-", dir=root)
    chmod_as_created(tmp_dir)  # mkdtemp's 0700 would become the checkpoint's mode
    return tmp_dir


def publish_folder(root: str, tmp_dir: str, name: str) -> Optional[str]:
    """Rename the finished folder ``tmp_dir`` into place as ``root/name``; returns an older
    folder of that name's new name (to delete once the tracker is written), if there was
    one."""
    final = os.path.join(root, name)
    backup = None
    if os.path.lexists(final):
        backup = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, backup)
    os.rename(tmp_dir, final)
    fsync_dir(root)
    return backup


def write_tracker(root: str, iteration: int, release: bool = False,
                  naming: Naming = MEGATRON) -> None:
    write_text_atomic(os.path.join(root, naming.tracker), naming.tracker_text(iteration, release))


def publish_checkpoint(root: str, tmp_dir: str, iteration: int, manifest: dict, *,
                       release: bool = False, naming: Naming = MEGATRON) -> str:
    """Finish a save whose files are all in ``tmp_dir``: write its manifest, rename it into
    place, then point the tracker at it. A failure before the rename removes ``tmp_dir``; the
    previous checkpoint stays the tracker's until the last step. Returns the folder."""
    name = naming.folder_name(iteration, release)
    try:
        write_manifest(tmp_dir, manifest)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    backup = publish_folder(root, tmp_dir, name)
    write_tracker(root, iteration, release, naming)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    return os.path.join(root, name)


def folder_digests(folder: str) -> dict[str, FileDigest]:
    """Every file under ``folder`` but the manifest (relative path with '/') -> its digest,
    read back: for folders another library wrote."""
    digests = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/")
            if rel != MANIFEST_FILENAME:
                digests[rel] = file_digest(os.path.join(parent, name))
    return digests

