"""Configuration as users meet it from the shell: an index cache built ahead with default
flags is found by training with default flags, ``--config``/``--dump-config`` through
pretrain_gpt.py, and the GPT-2 small example file building its model and taking steps."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.training_utils import base_argv

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, cwd=REPO, timeout=600) -> subprocess.CompletedProcess:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def _without(argv: list[str], *names: str) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in names:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(arg)
    return out


def test_index_cache_built_ahead_with_defaults_is_reused_by_training(corpus, tmp_path):
    cache = tmp_path / "cache"
    built = _run([sys.executable, REPO / "tools" / "build_index_cache.py",
                  "--data-path", corpus["prefix"], "--seq-length", "32",
                  "--train-iters", "4", "--global-batch-size", "4", "--eval-iters", "2",
                  "--eval-interval", "2", "--data-cache-path", cache])
    assert built.returncode == 0, built.stderr
    datasets = len(list(cache.rglob("*_doc_idx.npy")))  # train, valid (the test split of
    assert datasets >= 2                                 # 969, 30, 1 may hold no document)
    argv = _without(base_argv(corpus, str(cache), **{"--train-iters": 4, "--eval-iters": 2,
                                                     "--eval-interval": 2}), "--split")
    run = _run([sys.executable, REPO / "pretrain_gpt.py", *argv])
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout + run.stderr
    assert "built index cache" not in log
    assert len(re.findall(r"loaded index cache", log)) == datasets, log[-3000:]


def test_pretrain_reads_a_toml_config_and_dumps_the_effective_one(corpus, tmp_path):
    argv = base_argv(corpus, str(tmp_path / "cache"), **{"--train-iters": 3})
    dumped = tmp_path / "effective.toml"
    first = _run([sys.executable, REPO / "pretrain_gpt.py", *argv, "--dump-config", dumped])
    assert first.returncode == 0, first.stderr[-3000:]
    text = dumped.read_text()
    assert "[model]\nnum_layers = 2\n" in text and f'"{corpus["prefix"]}"' in text
    again = _run([sys.executable, REPO / "pretrain_gpt.py", "--config", dumped])
    assert again.returncode == 0, again.stderr[-3000:]

    def losses(out: str) -> list[str]:
        return re.findall(r"\| lm loss: ([0-9.E+-]+)", out)

    assert losses(again.stdout) == losses(first.stdout) and len(losses(first.stdout)) == 3
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nhidden_size = 'wide'\n")
    refused = _run([sys.executable, REPO / "pretrain_gpt.py", "--config", bad])
    assert refused.returncode == 2
    assert f"{bad}: [model] hidden_size must be an integer, got 'wide'" in refused.stderr


GPT2_SMALL = REPO / "examples" / "configs" / "gpt2-small.toml"


def _gpt2_small_data(corpus, folder: Path) -> None:
    """folder/data/ as the example's comment asks for it."""
    data = folder / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus["prefix"] + suffix, data / f"openwebtext_text_document{suffix}")
    flags = corpus["tokenizer_flags"]
    shutil.copy(flags[flags.index("--vocab-file") + 1], data / "gpt2-vocab.json")
    shutil.copy(flags[flags.index("--merge-file") + 1], data / "gpt2-merges.txt")


def _gpt2_small_parameters(vocab: int, positions: int) -> int:
    """GPT-2 small's parameter count: 12 layers 768 wide with biases, tied embedding."""
    h = 768
    layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (4 * h * h + 4 * h) + (4 * h * h + h)
    return vocab * h + positions * h + 12 * layer + 2 * h


def test_the_gpt2_small_parameter_count_is_gpt2s():
    # Hugging Face's gpt2 holds 124,439,808 parameters (its vocabulary of 50257 unpadded,
    # 1024 positions); nanoGPT prints the same less the positions, 123.65M.
    assert _gpt2_small_parameters(50257, 1024) == 124_439_808


@pytest.mark.shared_data
def test_the_gpt2_small_example_builds_gpt2_and_trains(corpus, tmp_path):
    """examples/configs/gpt2-small.toml as a user starts it, in a folder holding data/ as its
    comment says; only the length and batch of the run are cut for the CPU."""
    _gpt2_small_data(corpus, tmp_path)
    run = _run([sys.executable, REPO / "pretrain_gpt.py", "--config", GPT2_SMALL, "--use-cpu",
                "--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "1",
                "--seq-length", "32", "--eval-iters", "0", "--num-workers", "0",
                "--log-interval", "1"], cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    params = int(re.search(r"number of parameters on .*: (\d+)", run.stdout).group(1))
    printed = dict(re.findall(r"^  (\w+) \.+ (.*)$", run.stdout, re.M))
    # The vocabulary is the corpus tokenizer's: GPT-2's (50257, padded to 50304) with
    # ../shared, the fallback's 4096 without; 32 positions (the cut --seq-length).
    assert params == _gpt2_small_parameters(int(printed["padded_vocab_size"]), positions=32)
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+)", run.stdout)]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)


def test_use_checkpoint_args_takes_the_model_shape_from_the_checkpoint(corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = base_argv(corpus, str(tmp_path / "cache"), **{
        "--train-iters": 3, "--num-layers": 3, "--hidden-size": 48, "--num-attention-heads": 6,
        "--save": ckpt, "--save-interval": 2, "--exit-interval": 2, "--lr-warmup-iters": 1})
    first = _run([sys.executable, REPO / "pretrain_gpt.py", *argv])
    assert first.returncode == 0, first.stderr[-3000:]
    shape = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
             "--max-position-embeddings")
    resumed = _without(argv, *shape, "--save", "--save-interval", "--exit-interval")
    refused = _run([sys.executable, REPO / "pretrain_gpt.py", *resumed])
    assert refused.returncode == 2 and "--num-layers" in refused.stderr
    again = _run([sys.executable, REPO / "pretrain_gpt.py", *resumed, "--load", ckpt,
                  "--use-checkpoint-args"])
    assert again.returncode == 0, again.stderr[-3000:]
    printed = dict(re.findall(r"^  (\w+) \.+ (.*)$", again.stdout, re.M))
    assert (printed["num_layers"], printed["hidden_size"], printed["num_attention_heads"],
            printed["seq_length"]) == ("3", "48", "6", "32")
    assert re.search(r"iteration\s+3/\s*3", again.stdout), again.stdout[-2000:]


def test_tensorboard_interval_and_params_norm(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    argv = base_argv(corpus, str(tmp_path / "cache"), **{
        "--train-iters": 4, "--log-interval": 4, "--tensorboard-dir": tb,
        "--tensorboard-log-interval": 2, "--log-params-norm": True})
    run = _run([sys.executable, REPO / "pretrain_gpt.py", *argv])
    assert run.returncode == 0, run.stderr[-3000:]
    norms = [float(x) for x in re.findall(r"params norm: ([0-9.]+)", run.stdout)]
    assert len(norms) == 1 and norms[0] > 1.0  # one log line (iteration 4)
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [2, 4]
    assert [e.step for e in events.Scalars("params-norm")] == [2, 4]
    assert abs(events.Scalars("params-norm")[-1].value - norms[0]) < 1e-3 * norms[0]


def test_the_gpt2_small_examples_advice_shows_every_value_without_training(
        corpus, tmp_path, monkeypatch, capsys):
    """What the example's comment advises for seeing every value writes them and trains
    nothing (``--dump-config`` alone would start a 124M run)."""
    from megatron.training import pretrain

    advice = re.search(r"add (--dump-config FILE --dry-run)", " ".join(
        line.lstrip("# ") for line in GPT2_SMALL.read_text().splitlines()))
    assert advice, "gpt2-small.toml no longer advises --dump-config FILE --dry-run"
    _gpt2_small_data(corpus, tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(GPT2_SMALL)] + advice.group(1).replace("FILE", "all.toml").split()
    state = pretrain(None, None, None, argv=argv)
    assert state.iteration == 0 and not state.history
    assert "[model]\nnum_layers = 12\n" in (tmp_path / "all.toml").read_text()
    assert "training from iteration" not in capsys.readouterr().out
