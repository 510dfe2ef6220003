"""Each message is printed once, by global rank 0, unless --log-all-ranks: then every rank
prints, each line prefixed by its rank. Checked on a 2-rank torchrun run (data parallel 2,
gloo) that loads from an empty --load folder (a warning), builds real datasets and index
caches, evaluates, saves and writes TensorBoard."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

from tests.dist_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# torchrun's own lines (glog-style "W1124 08:00:05.632000 ...") are not the framework's.
LAUNCHER_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


def _two_ranks(corpus, folder, *extra) -> list[str]:
    flags = ["--use-cpu", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
             "2", "--seq-length", "16", "--max-position-embeddings", "16",
             "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3",
             "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
             "--split", "90,5,5", "--num-workers", "0", "--data-path", corpus["prefix"],
             "--data-cache-path", folder / "cache", "--load", folder / "ckpt",
             "--save", folder / "ckpt", "--save-interval", "2",
             "--tensorboard-dir", folder / "tb", *corpus["tokenizer_flags"], *extra]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "pretrain_gpt.py", *map(str, flags)],
        capture_output=True, text=True, cwd=REPO, timeout=240,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in (done.stdout + done.stderr).splitlines()
            if line.strip() and not LAUNCHER_LINE.match(line)]


def test_two_ranks_print_each_message_once(corpus, tmp_path):
    lines = _two_ranks(corpus, tmp_path)
    counts = collections.Counter(line for line in lines if set(line.strip()) != {"-"})
    assert [line for line, n in counts.items() if n > 1] == []
    for text in ("starting from scratch", " iteration        3/       3 |",
                 "successfully saved checkpoint at iteration       2", " run summary | "):
        assert sum(text in line for line in lines) == 1, text


def test_log_all_ranks_prefixes_every_line(corpus, tmp_path):
    lines = _two_ranks(corpus, tmp_path, "--log-all-ranks")
    ranks = [re.match(r"\[rank (\d)\] ", line) for line in lines]
    assert all(ranks), [line for line, m in zip(lines, ranks) if not m]
    for rank in ("0", "1"):
        own = [line for line, m in zip(lines, ranks) if m.group(1) == rank]
        for text in ("starting from scratch", " iteration        3/       3 |",
                     " run summary | "):
            assert sum(text in line for line in own) == 1, (rank, text)
