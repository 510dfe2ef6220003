"""tools/preprocess_data.py under faults: killed workers and parents, SIGTERM, a full disk,
empty or truncated input, an unwritable output folder. Each run must stop with a clear message
and leave no temporary or partition files behind."""

from __future__ import annotations

import errno
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.shared_data import gpt2_skip_reason, have_gpt2_files
from tests.unit.tokenizer.strings import MERGES, VOCAB

psutil = pytest.importorskip("psutil")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")

pytestmark = [pytest.mark.shared_data,
              pytest.mark.skipif(not have_gpt2_files(), reason=gpt2_skip_reason() or "")]


def tool_args(inputs, prefix, *extra):
    return ["--input", *map(str, inputs), "--output-prefix", str(prefix),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB,
            "--merge-file", MERGES, *map(str, extra)]


def run_tool(inputs, prefix, *extra):
    return subprocess.run([sys.executable, TOOL, *tool_args(inputs, prefix, *extra)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def start_tool(inputs, prefix, *extra):
    return subprocess.Popen([sys.executable, TOOL, *tool_args(inputs, prefix, *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def left_behind(folder, keep):
    """Everything in ``folder`` but the inputs, hidden partition folders included."""
    return sorted(set(os.listdir(folder)) - set(keep))


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """~95 MB of text: several seconds even for the tiktoken backend, so runs are caught
    mid-way; each test stops its run early."""
    path = tmp_path_factory.mktemp("corpus") / "big.jsonl"
    line = json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 40}) + "\n"
    with open(path, "w") as f:
        f.write(line * 52_000)
    return path


def wait_for_children(proc, count, timeout=30.0):
    """The tool's descendants once at least ``count`` exist (they start after the tokenizer)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        children = psutil.Process(proc.pid).children(recursive=True)
        if len(children) >= count:
            time.sleep(0.2)  # let them start working
            return psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.05)
    raise AssertionError(f"the tool started fewer than {count} child processes")


def finish(proc, timeout=20.0):
    """(returncode, stderr); kills the tool and fails if it does not exit in time."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.communicate()
        raise AssertionError(f"the tool did not exit within {timeout} s") from None
    return proc.returncode, err


def all_gone(processes, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in processes
                 if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    for p in alive:
        p.kill()
    return False


def test_killed_worker_stops_the_run_naming_it(tmp_path, big_corpus):
    proc = start_tool([big_corpus], tmp_path / "out", "--workers", "2")
    victim = wait_for_children(proc, 2)[0]
    victim.send_signal(signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1, err
    assert f"pid {victim.pid}" in err and "SIGKILL" in err, err
    assert "Traceback" not in err
    assert left_behind(tmp_path, []) == []


def test_killed_partition_child_stops_the_run_naming_it(tmp_path, big_corpus):
    proc = start_tool([big_corpus], tmp_path / "out", "--workers", "2", "--partitions", "2")
    wait_for_children(proc, 2)
    victim = psutil.Process(proc.pid).children()[0]  # a partition process, not a worker
    victim.send_signal(signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1, err
    assert "partition" in err and f"pid {victim.pid}" in err and "SIGKILL" in err, err
    assert left_behind(tmp_path, []) == []


def test_killed_parent_takes_its_partition_children_along(tmp_path, big_corpus):
    proc = start_tool([big_corpus], tmp_path / "out", "--workers", "4", "--partitions", "2")
    children = wait_for_children(proc, 4)  # two partitions, each with two workers
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert all_gone(children), "partition or worker processes outlived their parent"
    # Nothing can clean up after SIGKILL; what is left is one hidden, temporary-named folder.
    leftovers = left_behind(tmp_path, [])
    assert all(name.startswith(".out.partitions-") and name.endswith(".tmp")
               for name in leftovers), leftovers


def test_sigterm_removes_partition_files_and_children(tmp_path, big_corpus):
    proc = start_tool([big_corpus], tmp_path / "out", "--workers", "4", "--partitions", "2")
    children = wait_for_children(proc, 4)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 128 + signal.SIGTERM and "terminated" in err, (code, err)
    assert all_gone(children)
    assert left_behind(tmp_path, []) == []


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"], ids=["empty", "blank-lines"])
def test_no_documents_is_an_error_unless_allowed(tmp_path, content):
    src = tmp_path / "c.jsonl"
    src.write_bytes(content)
    for partitions in ("1", "2"):
        proc = run_tool([src], tmp_path / "out", "--partitions", partitions)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "no documents" in proc.stderr and str(src) in proc.stderr
        assert "--allow-empty" in proc.stderr
        assert left_behind(tmp_path, ["c.jsonl"]) == []
    proc = run_tool([src], tmp_path / "out", "--allow-empty")
    assert proc.returncode == 0, proc.stderr
    assert len(MMapIndexedDataset(str(tmp_path / "out_text_document"))) == 0


def test_unwritable_output_folder_named_before_work(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": "a"}) + "\n")
    if os.geteuid() == 0:
        out_dir = "/sys"  # root may write anywhere chmod allows; sysfs refuses new files
    else:
        out_dir = tmp_path / "ro"
        out_dir.mkdir(mode=0o555)
    proc = run_tool([src], os.path.join(out_dir, "out"))
    assert proc.returncode == 1
    assert "--output-prefix" in proc.stderr and "not writable" in proc.stderr
    assert str(out_dir) in proc.stderr and "Traceback" not in proc.stderr


def test_truncated_gzip_input_is_named(tmp_path):
    data = gzip.compress(b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n"
                                  for i in range(2000)))
    src = tmp_path / "c.jsonl.gz"
    src.write_bytes(data[: len(data) // 2])
    for workers in ("1", "2"):
        proc = run_tool([src], tmp_path / "out", "--workers", workers)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert str(src) in proc.stderr and "truncated" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert left_behind(tmp_path, ["c.jsonl.gz"]) == []


class FullDisk:
    """A file on a disk with ``room`` bytes left: writes past it, and closing with unwritten
    data, fail with ENOSPC as a buffered file on a full disk does."""

    def __init__(self, path, mode, room, **kwargs):
        self.file = open(path, mode, buffering=0)
        self.name = path
        self.room = room

    def write(self, data):
        data = bytes(data)
        if len(data) > self.room:
            self.stuck = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    @property
    def closed(self):
        return self.file.closed

    def close(self):
        self.file.close()
        if getattr(self, "stuck", False):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_full_disk_names_the_output_and_removes_temporaries(tmp_path, monkeypatch, capsys):
    from megatron.data import indexed_dataset
    from tools.preprocess_data import main

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n"
                           for i in range(500)))
    monkeypatch.setattr(indexed_dataset, "open",
                        lambda path, mode="r", **kw: FullDisk(path, mode, room=20_000),
                        raising=False)
    for partitions in ("1", "2"):
        assert main(tool_args([src], tmp_path / "out", "--partitions", partitions)) == 1
        err = capsys.readouterr().err
        assert "cannot write" in err and "No space left on device" in err, err
        assert str(tmp_path) in err  # the output (or partition) file being written
        assert left_behind(tmp_path, ["c.jsonl"]) == []
