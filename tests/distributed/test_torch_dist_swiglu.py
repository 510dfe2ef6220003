"""--ckpt-format torch_dist with the Llama family's options (SwiGLU's first projection is two
parts per tensor rank, stored as megatron-core does: tests/unit/test_torch_dist_format.py):
saved at tensor 2 x data 2 with the distributed optimizer (flat shards crossing the gate/up
boundary), it resumes at tensor 1 x data 1 with the uninterrupted run's losses, and the
whole-checkpoint reader gives the same model as the torch format saved by the same run."""

from __future__ import annotations

import os

import pytest
import torch

from megatron.conversion import load_full_checkpoint
from tests.dist_utils import run_distributed
from tests.distributed.mcore_utils import train_losses
from tests.distributed.training_utils import LLAMA_FLAGS, flags_to_argv

pytestmark = pytest.mark.slow  # two 4-rank trainings and one resume, about 40 s
SAVED_AT, ITERS = 3, 5
FLAGS = {
    "--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4, "--seq-length": 16,
    "--max-position-embeddings": 16, "--micro-batch-size": 1, "--global-batch-size": 4,
    "--lr": 3e-3, "--min-lr": 3e-4, "--lr-warmup-iters": 1, "--lr-decay-style": "cosine",
    "--clip-grad": 1.0, "--hidden-dropout": 0.0, "--attention-dropout": 0.0,
    "--eval-iters": 0, "--num-workers": 0, "--mock-data": True,
    # 256 ids (255 and the end-of-document token): no padding at tp 1 or 2, so both layouts
    # compute the same softmax
    "--tokenizer-type": "NullTokenizer", "--vocab-size": 255,
    "--make-vocab-size-divisible-by": 64, "--seed": 1234,
    "--use-cpu": True, "--use-distributed-optimizer": True, "--train-iters": ITERS,
    **LLAMA_FLAGS,
}


def _save_both_formats(rank, world_size, folder):
    argv = flags_to_argv({**FLAGS, "--tensor-model-parallel-size": 2,
                          "--save-interval": SAVED_AT})
    runs = {fmt: train_losses(argv + ["--save", os.path.join(folder, fmt), "--ckpt-format", fmt])
            for fmt in ("torch_dist", "torch")}
    return runs


def _resume_at_tp1(rank, world_size, load):
    return train_losses(flags_to_argv({**FLAGS, "--load": load}))


def test_swiglu_torch_dist_resumes_at_another_layout_and_reads_whole(tmp_path):
    per_rank = run_distributed(_save_both_formats, 4, str(tmp_path), timeout=600)
    runs = per_rank[0]
    assert runs["torch_dist"] == runs["torch"]  # the format does not change the training
    load = tmp_path / "torch_dist"
    for fmt in ("torch_dist", "torch"):  # resume from the middle of the run
        (tmp_path / fmt / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    dist_full = load_full_checkpoint(str(load))
    torch_full = load_full_checkpoint(str(tmp_path / "torch"))
    assert dist_full.model.keys() == torch_full.model.keys()
    for name, value in torch_full.model.items():
        assert torch.equal(dist_full.model[name], value), name
    for name, state in torch_full.optimizer["param_state"].items():
        for kind, value in state.items():
            assert torch.equal(dist_full.optimizer["param_state"][name][kind], value), \
                (name, kind)
    resumed = run_distributed(_resume_at_tp1, 1, str(load), timeout=600)[0]
    assert [it for it, _ in resumed] == [4, 5]
    for (_, got), (_, want) in zip(resumed, runs["torch_dist"][SAVED_AT:]):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, runs["torch_dist"])
