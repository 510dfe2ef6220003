"""Shared pieces of the dataset builders: ``--split`` and ``--data-path`` parsing, sample counts,
and the on-disk index cache (lookup, file lock, atomic writes).

No torch import: tools/build_index_cache.py builds caches without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Optional, Union

import numpy as np

from megatron.platform.file_modes import write_failure

logger = logging.getLogger(__name__)

DataPath = Union[str, Sequence[str], None]


# --split's default, spelled as Megatron-DeepSpeed spells it: index-cache file names hash the
# string, so caches built ahead with default flags (by tools/build_index_cache.py, by
# pretrain_gpt.py or by Megatron-DeepSpeed) are found by every other.
DEFAULT_SPLIT = "969, 30, 1"


class DataConfigError(ValueError):
    """A data flag (--data-path, --split, ...) is malformed; the message names it."""


# ----------------------------------------------------------------------------------------------
# --split and --data-path
# ----------------------------------------------------------------------------------------------


def parse_split(splits_string: str) -> list[float]:
    """The three train/valid/test weights of ``--split`` (``969, 30, 1``, ``98,2,0``, ``1``,
    ``90/10``; missing parts are 0), as given: not normalised."""
    text = str(splits_string)
    sep = "," if "," in text else "/" if "/" in text else None
    parts = text.split(sep) if sep else [text]
    if len(parts) > 3:
        raise DataConfigError(f"--split {splits_string!r}: at most three weights "
                              "(train, valid, test)")
    try:
        weights = [float(s) for s in parts]
    except ValueError:
        raise DataConfigError(f"--split {splits_string!r}: expected numbers like 969,30,1") from None
    weights = (weights + [0.0, 0.0])[:3]
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise DataConfigError(f"--split {splits_string!r}: weights must be >= 0 with a positive sum")
    return weights


def get_train_valid_test_split_(splits_string: str, size: int) -> list[int]:
    """Document boundaries [0, a, b, size] for ``--split``: the weights are normalised and
    rounded as Megatron does."""
    weights = parse_split(splits_string)
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(size))))
    # Rounding may over- or undershoot; Megatron moves every boundary after the first by the
    # difference so that the last one is exactly `size`.
    diff = bounds[-1] - size
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return bounds


def parse_data_path(data_path: DataPath, flag_name: str = "--data-path"
                    ) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """(prefixes, weights) of ``prefix`` or ``w1 p1 w2 p2 ...``; weights None for one prefix.

    Weights are returned as given (not normalised); each must be a positive number.
    """
    if data_path is None:
        return None
    items = [data_path] if isinstance(data_path, str) else [str(x) for x in data_path]
    if len(items) == 1 and len(items[0].split()) > 1 and _is_number(items[0].split()[0]):
        items = items[0].split()  # "0.35 wiki 0.65 owt" given as one string
    if not items:
        return None
    if len(items) == 1:
        return [items[0].strip()], None
    if len(items) % 2:
        raise DataConfigError(
            f"{flag_name}: expected one prefix or weight/prefix pairs, got {len(items)} values "
            f"{items}")
    prefixes, weights = [], []
    for position, (weight_text, prefix) in enumerate(zip(items[0::2], items[1::2]), start=1):
        try:
            weight = float(weight_text)
        except ValueError:
            raise DataConfigError(f"{flag_name}: weight {position} ({weight_text!r}, before "
                                  f"{prefix!r}) is not a number (expected WEIGHT PREFIX "
                                  "pairs)") from None
        if not math.isfinite(weight) or weight <= 0:
            raise DataConfigError(f"{flag_name}: weight {position} of the blend is not positive: "
                                  f"weight {weight_text} of {prefix!r} (a dataset no sample is "
                                  "drawn from is an error)")
        prefixes.append(prefix.strip())
        weights.append(weight)
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def normalize_weights(weights: Sequence[float]) -> list[float]:
    total = 0.0
    for w in weights:  # summed in order, as Megatron does, so the floats match bit for bit
        total += w
    return [w / total for w in weights]


def get_datasets_weights_and_num_samples(data_prefix: Sequence[str],
                                         train_valid_test_num_samples: Sequence[int]
                                         ) -> tuple[list[str], list[float], list[list[int]]]:
    """Megatron's per-dataset sample requests: ceil(n * weight * 1.005) for each split, the
    0.5% margin absorbing the blend's rounding."""
    parsed = parse_data_path(data_prefix)
    if parsed is None or parsed[1] is None:
        raise DataConfigError("--data-path: a blend needs weight/prefix pairs")
    prefixes, weights = parsed
    weights = normalize_weights(weights)
    counts = [[int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples]
              for w in weights]
    return prefixes, weights, counts


def train_valid_test_num_samples(global_batch_size: int, eval_iters: int, eval_interval: int,
                                 train_iters: Optional[int] = None,
                                 train_samples: Optional[int] = None) -> list[int]:
    """[train, valid, test] sample counts exactly as Megatron-DeepSpeed derives them."""
    if (train_iters is None) == (train_samples is None):
        raise DataConfigError("give exactly one of --train-iters and --train-samples")
    if train_samples is None:
        train_samples = train_iters * global_batch_size
    else:
        train_iters = train_samples // global_batch_size
    if eval_interval <= 0:
        raise DataConfigError(f"--eval-interval must be positive, got {eval_interval}")
    valid_iters = (train_iters // eval_interval + 1) * eval_iters
    return [train_samples, valid_iters * global_batch_size, eval_iters * global_batch_size]


# ----------------------------------------------------------------------------------------------
# Index cache
# ----------------------------------------------------------------------------------------------


def default_user_cache_dir() -> str:
    """Where caches go when neither the data folder nor --data-cache-path is writable."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-gpt", "index-cache")


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def log_rank0(msg: str, *args: object, level: int = logging.INFO) -> None:
    if is_rank_zero():
        logger.log(level, msg, *args)


def description_hash(desc: str) -> str:
    """md5 of the description text: Megatron-DeepSpeed's cache-name scheme."""
    return hashlib.md5(desc.encode("utf-8")).hexdigest()


def _unwritable_reason(path: str) -> Optional[str]:
    """None when ``path`` is (or can be made) a folder a file can be created in, else why not."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-probe-{socket.gethostname()}-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
        return None
    except OSError as e:
        return e.strerror or str(e)


class IndexCache:
    """Finds, locks and writes the .npy index files of one dataset description.

    Lookup order (Megatron-DeepSpeed's, plus a user fallback): ``<data dir>/index-cache``,
    then ``--data-cache-path``, then ``default_user_cache_dir()``.  A missing set is built in
    ``--data-cache-path`` if given (an error naming the flag when it is not writable: the
    user chose it), else in ``<data dir>/index-cache``, or, when that folder is not writable,
    in the user folder with a warning.  A cached file that cannot be read (truncated, not
    .npy) counts as missing and is rebuilt.
    """

    def __init__(self, data_prefix: str, data_cache_path: Optional[str] = None,
                 user_cache_dir: Optional[str] = None, lock_timeout_s: float = 7200.0) -> None:
        beside_data = os.path.join(os.path.dirname(os.path.abspath(data_prefix)), "index-cache")
        self.user_dir = user_cache_dir or default_user_cache_dir()
        self.lookup_dirs = [beside_data] + ([data_cache_path] if data_cache_path else [])
        self.lookup_dirs.append(self.user_dir)
        self.data_cache_path = data_cache_path
        self.preferred_dir = data_cache_path or beside_data
        self.lock_timeout_s = lock_timeout_s

    def candidates(self, names: Sequence[str]) -> list[str]:
        """The lookup folders that hold every file in ``names``, in lookup order."""
        return [folder for folder in self.lookup_dirs
                if all(os.path.isfile(os.path.join(folder, n)) for n in names)]

    def build_dir(self) -> str:
        reason = _unwritable_reason(self.preferred_dir)
        if reason is None:
            return self.preferred_dir
        if self.data_cache_path:
            raise DataConfigError(f"--data-cache-path {self.data_cache_path!r} is not a "
                                  f"writable folder ({reason}); the index cache cannot be "
                                  "written there")
        if _unwritable_reason(self.user_dir) is not None:
            raise OSError(f"cannot write the dataset index cache: neither {self.preferred_dir} "
                          f"nor {self.user_dir} is writable; set --data-cache-path")
        logger.warning("index cache folder %s is not writable; using %s instead (set "
                       "--data-cache-path to choose)", self.preferred_dir, self.user_dir)
        return self.user_dir

    def load_or_build(self, key: str, names: Sequence[str],
                      build: Callable[[], dict[str, np.ndarray]],
                      validate: Callable[[dict[str, np.ndarray]], Optional[str]],
                      extra_files: Optional[dict[str, str]] = None,
                      optional_files: Optional[dict[str, str]] = None) -> dict[str, np.ndarray]:
        """Load the arrays ``names`` (file names) or build, save and load them.

        ``build`` returns {name: array}; ``validate`` returns None or why loaded arrays do not
        fit (they are then rebuilt).  ``extra_files`` ({name: text}, e.g. the description) are
        written after the arrays and must exist for a hit; ``optional_files`` are written last
        and not required (caches written by Megatron-DeepSpeed lack them).  Building happens under an flock on ``<key>.lock`` so
        concurrent processes on one node (or a shared file system) build it once.
        """
        check_names = list(names) + list(extra_files or {})
        for folder in self.candidates(check_names):
            arrays, problem = _load_valid_arrays(folder, names, validate)
            if problem is None:
                log_rank0(" > loaded index cache %s from %s", key, folder)
                return arrays
            logger.warning("index cache %s in %s does not fit this data (%s); ignoring it",
                           key, folder, problem)
        folder = self.build_dir()
        with FileLock(os.path.join(folder, key + ".lock"), self.lock_timeout_s):
            if all(os.path.isfile(os.path.join(folder, n)) for n in check_names):
                arrays, problem = _load_valid_arrays(folder, names, validate)
                if problem is None:  # another process built it while we waited
                    return arrays
            start = time.time()
            built = build()
            write_cache_set(folder, {name: built[name] for name in names},
                       {**(extra_files or {}), **(optional_files or {})})
            log_rank0(" > built index cache %s in %s (%.2f s)", key, folder, time.time() - start)
        return _load_arrays(folder, names)


def write_cache_set(folder: str, arrays: dict[str, np.ndarray], texts: dict[str, str]) -> None:
    """Write one cache set (arrays, then texts); a failed write (a full --data-cache-path)
    removes what this set had written and becomes a ``DataConfigError`` naming the file and
    the space it needed."""
    written = []
    try:
        for name, array in arrays.items():
            save_npy_atomic(os.path.join(folder, name), array)
            written.append(name)
        for name, text in texts.items():
            write_text_atomic(os.path.join(folder, name), text)
            written.append(name)
    except OSError as error:
        for name in written:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))
        name = next(n for n in [*arrays, *texts] if n not in written)
        needed = sum(int(np.asarray(a).nbytes) for a in arrays.values()) + sum(
            len(t.encode()) for t in texts.values())
        failure = write_failure(os.path.join(folder, name), error, needed)
        raise DataConfigError(f"the dataset index cache: {failure}; free space there or point "
                              "--data-cache-path elsewhere") from None


def _load_arrays(folder: str, names: Sequence[str]) -> dict[str, np.ndarray]:
    return {n: np.load(os.path.join(folder, n), allow_pickle=False, mmap_mode="r") for n in names}


def _load_valid_arrays(folder: str, names: Sequence[str],
                       validate: Callable[[dict[str, np.ndarray]], Optional[str]]
                       ) -> tuple[Optional[dict[str, np.ndarray]], Optional[str]]:
    """(arrays, None) for a usable cached set, else (None, why not): a file numpy cannot map
    (truncated by a full disk or a copy cut short, or not .npy at all) is a miss, not an error."""
    arrays = {}
    for name in names:
        path = os.path.join(folder, name)
        try:
            arrays[name] = np.load(path, allow_pickle=False, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            return None, f"{path} cannot be read: {e}"
    problem = validate(arrays)
    return (None, problem) if problem else (arrays, None)


def _tmp_name(path: str) -> str:
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"


def save_npy_atomic(path: str, array: np.ndarray) -> None:
    """np.save to a temporary name, then rename: readers never see a partial file."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(array), allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path: str, text: str) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def json_text(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


class FileLock:
    """An exclusive ``fcntl.flock`` on ``path``, polled until ``timeout_s``.

    The kernel drops the lock when its holder dies, so a crashed builder never blocks others;
    the lock file itself is left in place and is harmless.
    """

    def __init__(self, path: str, timeout_s: float = 7200.0, poll_s: float = 0.2) -> None:
        self.path, self.timeout_s, self.poll_s = path, timeout_s, poll_s
        self._fd: Optional[int] = None

    def __enter__(self) -> FileLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        deadline = time.monotonic() + self.timeout_s
        waited = False
        while not self._try_lock():
            if time.monotonic() > deadline:
                os.close(self._fd)
                self._fd = None
                raise TimeoutError(
                    f"waited {self.timeout_s:.0f} s for {self.path}: another process is "
                    "still building this index cache")
            if not waited:
                log_rank0(" > waiting for %s (another process builds the cache)", self.path)
                waited = True
            time.sleep(self.poll_s)
        return self

    def _try_lock(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as e:
            # Some network file systems refuse flock (ENOLCK). Building without the lock is
            # still safe: every file is written under a unique name and then renamed.
            logger.warning("cannot lock %s (%s); building without a lock", self.path, e)
            os.close(self._fd)
            self._fd = None
            return True

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
