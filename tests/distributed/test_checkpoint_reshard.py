"""Training resumed after a reshard continues the loss curve.

A run at tp 2 x pp 2 with the distributed optimizer trains 8 iterations and saves at
iteration 3; tools/checkpoint/convert.py reshards that checkpoint (model, optimizer state, LR
schedule, consumed samples) to tp 1 x pp 1; two data-parallel ranks with the distributed
optimizer resume from it (the torch-format optimizer files are loaded by a real optimizer in
tests/unit/test_conversion.py). Its losses for iterations 4-8 equal the unresharded run's within 1e-5 relative
(measured: 4.3e-8 at most). They would not without the optimizer state: a tp 1 checkpoint
converted to tp 1 and resumed with --no-load-optim was 6e-4 to 1.2e-3 relative off in
iterations 5-8 (measured; with the state: bit-identical).
"""

from __future__ import annotations

import pytest

import pretrain_gpt
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import captured_stdout
from tools.checkpoint import convert

SAVED_AT, ITERS = 3, 8
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "3e-3",
         "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
         "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--eval-iters", "0", "--num-workers", "0", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "255", "--make-vocab-size-divisible-by", "64",
         "--seed", "1234", "--use-cpu"]


def _train(rank, world_size, argv):
    with captured_stdout():
        state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                         pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    return [(h["iteration"], h["losses"]["lm loss"]) for h in state.history if h["losses"]]


def _losses(world_size: int, argv: list[str]) -> list[tuple[int, float]]:
    """The losses of the rank that reports them (the last pipeline stage)."""
    return [run for run in run_distributed(_train, world_size, argv) if run][-1]


def test_resume_after_reshard_continues_the_loss_curve(tmp_path):
    saved, resharded = str(tmp_path / "saved"), str(tmp_path / "resharded")
    unresharded = _losses(4, FLAGS + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--save", saved, "--save-interval", str(SAVED_AT)])
    assert [it for it, _ in unresharded] == list(range(1, ITERS + 1))
    assert convert.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron",
                         "--load-dir", saved, "--save-dir", resharded, "--iteration",
                         str(SAVED_AT), "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0
    resumed = _losses(2, FLAGS + ["--use-distributed-optimizer", "--load", resharded])
    assert [it for it, _ in resumed] == list(range(SAVED_AT + 1, ITERS + 1))
    got, want = [loss for _, loss in resumed], [loss for _, loss in unresharded[SAVED_AT:]]
    print("max relative difference:", max(abs(a - b) / abs(b) for a, b in zip(got, want)))
    assert got == pytest.approx(want, rel=1e-5)
