"""--wandb-project: an offline Weights & Biases run beside TensorBoard (issue 15, item 5).

The run's ``.wandb`` file is read back with wandb's own protobuf ``Record`` (the file is
LevelDB's log format, which wandb 0.31 no longer ships a Python reader for; ``_records``
below reads it): every scalar TensorBoard holds against the iteration is in the wandb history
at the same step with the same value.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from megatron.config import ConfigError
from tests.distributed.training_utils import base_argv, build_small_corpus

wandb = pytest.importorskip("wandb")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 32768  # LevelDB log blocks; each record has a 7-byte header (crc, length, type)


def _records(path: str):
    """The raw protobuf records of a .wandb file (FULL, or FIRST/MIDDLE/LAST fragments)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload


def wandb_history(run_file: str) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of the history records in ``run_file``."""
    from wandb.proto import wandb_internal_pb2

    history = {}
    for raw in _records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            history[int(row["_step"])] = row
    return history


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wandb")
    corpus = build_small_corpus(str(folder / "corpus"), max_chars=100_000)
    argv = base_argv(corpus, str(folder / "cache"), **{
        "--train-iters": 4, "--eval-interval": 2, "--eval-iters": 1, "--split": "90,10,0",
        "--tensorboard-dir": str(folder / "tb"), "--wandb-project": "gpt2-toy",
        "--wandb-exp-name": "offline-test", "--wandb-save-dir": str(folder / "wb"),
        "--log-params-norm": True})
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "WANDB_MODE")}
    env.update(OMP_NUM_THREADS="1", WANDB_CONFIG_DIR=str(folder / "cfg"),
               WANDB_CACHE_DIR=str(folder / "cfg"), WANDB_DATA_DIR=str(folder / "cfg"))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder, proc


def test_offline_run_holds_the_tensorboard_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, _ = run
    files = glob.glob(str(folder / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    history = wandb_history(files[0])
    assert sorted(history) == [1, 2, 3, 4]
    acc = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    compared = 0
    for tag in acc.Tags()["scalars"]:
        if tag.endswith((" vs samples", " vs tokens")) or ",x=samples" in tag \
                or ",x=tokens" in tag:
            continue  # TensorBoard's views against samples/tokens: not iteration steps
        for event in acc.Scalars(tag):
            assert history[event.step][tag] == pytest.approx(event.value, rel=1e-6), tag
            compared += 1
    for tag in ("lm loss", "lm-loss-training/lm loss", "learning-rate", "grad-norm",
                "params-norm", "lm loss validation", "steps-vs-samples/y=samples,x=steps"):
        assert tag in history[4], (tag, sorted(history[4]))
    assert compared >= 4 * 10


def test_missing_wandb_is_a_clear_error(monkeypatch):
    import importlib.util

    from megatron.config import parse_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--wandb-project needs the wandb package.*pip "
                                          r"install"):
        parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "32", "--max-position-embeddings", "32",
                    "--micro-batch-size", "2", "--train-iters", "1", "--mock-data",
                    "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                    "--wandb-project", "p"])
