"""The GPT-3 175B recipe rehearsed through its own script (REHEARSE=1 bash
examples/gpt3/train_gpt3_175b_distributed.sh ...): 64 ranks (tensor 8 x pipeline 8), 128 ranks
(x data 2, with the distributed optimizer the script passes) and the interleaved schedule
(pipeline 8 x 2 virtual stages), shrunk to hidden 96 and 8 tokens per sequence; the layers,
heads, layout and micro-batches are the recipe's. The checker passes, the table prints, and
the planner and the communication formula equal what the rehearsed ranks held and issued.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "gpt3" / "train_gpt3_175b_distributed.sh"
GPT2_VOCAB = 50257
SHRINK = ["--rehearse-hidden-size", "96", "--rehearse-seq-length", "8"]


def _tokenizer_files(tmp_path: Path) -> tuple[str, str]:
    """A stand-in of GPT-2's vocabulary: its 50257 entries, ``<|endoftext|>`` last as in
    GPT-2, and no merges. A rehearsal reads only the vocabulary's size and its end-of-document
    token, so the test is the same with or without the real files."""
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    entries = {f"t{i}": i for i in range(GPT2_VOCAB - 1)}
    entries["<|endoftext|>"] = GPT2_VOCAB - 1
    vocab.write_text(json.dumps(entries))
    merges.write_text("#version: 0.2\n")
    return str(vocab), str(merges)


def _rehearse(tmp_path: Path, *flags: str, **env: str) -> str:
    vocab, merges = _tokenizer_files(tmp_path)
    run_env = {**os.environ, "REHEARSE": "1", "OMP_NUM_THREADS": "1", **env,
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "checkpoints"), str(tmp_path / "tb"), vocab,
         merges, *SHRINK, *flags], capture_output=True, text=True, env=run_env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "tb").exists()
    return out


def _row(out: str, name: str) -> list[str]:
    """A table row's two values (fullest rank, emptiest rank)."""
    line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
    return re.findall(r"[\d.]+ (?:[KMGT]?B|[KMGT])|0 B", line[len(name) + 2:])


def _check_common(out: str) -> None:
    assert "rehearsal passed:" in out
    assert "96 layers, 96 heads, hidden 96 (run: 12288), sequence 8 (run: 2048), float16" in out
    assert "174.62 G parameters" in out  # the recipe's model, counted at its real size
    checks = [line for line in out.splitlines()
              if re.match(r"  rank \d+ \(stage \d+, tensor 0, data 0\): weights", line)]
    assert len(checks) == 8
    for line in checks:  # planner and formula at the rehearsal's size = what the ranks did
        for item in line.split(": ", 1)[1].split(", "):
            kind, ratio = item.rsplit(" ", 1)
            assert ratio == "1.000", line


@pytest.mark.slow
def test_the_175b_recipe_rehearses_at_64_ranks(tmp_path):
    out = _rehearse(tmp_path)
    assert ("tensor 8 x pipeline 8 x data 1 = 64 ranks, sequence parallel, distributed "
            "optimizer") in out
    assert ("11 ranks run (the first rank of each stage, and the last of stages 0, 1, 7 to "
            "check that a stage's ranks are alike; the other 53") in out
    assert "one iteration of 16 micro-batches per pipeline" in out  # the ramp-up's start
    _check_common(out)
    assert "fullest: rank 0 (stage 0, tensor 0, data 0)" in out
    assert _row(out, "parameters")[0] == "2.82 G"
    assert _row(out, "total (peak)")[0] == "52.58 GB"
    assert _row(out, "tp all-gather") == ["54.75 GB", "54.00 GB"]  # + the embedding's


@pytest.mark.slow
def test_the_175b_recipe_rehearses_at_128_ranks_with_the_distributed_optimizer(tmp_path):
    out = _rehearse(tmp_path, NUM_NODES="16")
    assert "tensor 8 x pipeline 8 x data 2 = 128 ranks" in out
    assert "11 ranks run (the first rank of each stage, and the last of stages 0, 1, 7" in out
    assert "one iteration of 8 micro-batches per pipeline" in out
    _check_common(out)
    assert _row(out, "dp reduce")[0] == "5.26 GB"  # fp16 gradients, reduce-scattered
    assert _row(out, "dp gather")[0] == "5.26 GB"  # fp16 parameters, all-gathered
    assert _row(out, "optimizer")[0] == "15.77 GB"  # 12 bytes per parameter over 2 ranks


@pytest.mark.slow
def test_the_175b_recipe_rehearses_interleaved(tmp_path):
    out = _rehearse(tmp_path, "--num-layers-per-virtual-pipeline-stage", "6")
    assert "= 64 ranks, 2 virtual stages" in out
    _check_common(out)
    assert _row(out, "pp send")[0] == "288.00 MB"  # 2 chunks: 3 neighbours x 16 micro-batches
