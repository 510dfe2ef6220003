"""DeepSpeed-MoE under --deepspeed (Megatron-DeepSpeed's experts): ``deepspeed.moe.layer.MoE``
in the layers' MLP place with our MLP as its expert, its load-balancing loss x
--moe-loss-coeff added to the loss and reported as ``moe loss``. Dropless top-2 with the
second expert chosen by rank (--disable-moe-token-dropping
--disable-moe-top2-2nd-expert-sampling): expert parallel 2 under ZeRO 1 and 2 equals one rank
within 1e-5 (language-model loss, moe loss, grad norm), the first loss equals the built-in MoE
layer's on the same weights, a DeepSpeed checkpoint resumes the same run, and its weights
convert to ours (the optimizer state does not)."""

from __future__ import annotations

import math
import shutil

import pytest

import pretrain_gpt
from tests.dist_utils import run_distributed
from tests.distributed.test_deepspeed_engine import argv
from tools.checkpoint import convert

pytestmark = pytest.mark.skipif(shutil.which("deepspeed") is None,
                                reason="deepspeed is not installed")
MOE = {"--num-experts": 4, "--topk": 2, "--disable-moe-token-dropping": True,
       "--disable-moe-top2-2nd-expert-sampling": True, "--moe-loss-coeff": 0.1,
       "--lr-warmup-iters": 0}


def _flags(**more) -> list[str]:
    return argv(**{"--deepspeed": True, "--no-pipeline-parallel": True, **MOE, **more})


def _train(rank, world_size, args):
    state = pretrain_gpt.main(args)
    return [(h["losses"]["lm loss"], h["losses"].get("moe loss"), h["grad_norm"])
            for h in state.history if h["losses"]]


def _run(world: int, args: list[str]):
    # Every run in a spawned process: a run inside pytest's own process (or a fork of one
    # that ran DeepSpeed) leaves process-group state and threads that later forks inherit.
    runs = run_distributed(_train, world, args)
    assert all(r == runs[0] for r in runs[1:])
    return runs[0]


def _same(got, want, rel=1e-5):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a, b):
            assert (x is None) == (y is None) and (x is None or math.isclose(x, y, rel_tol=rel)), (
                i, a, b)


@pytest.fixture(scope="module")
def reference():
    """One rank, ZeRO 1, all four experts on it."""
    run = _run(1, _flags(**{"--zero-stage": 1, "--create-moe-param-group": True}))
    # DeepSpeed's l_aux is about 1 per layer near balance: 0.1 x 2 layers.
    assert all(0.15 < moe < 0.3 for _, moe, _ in run)
    return run


@pytest.mark.parametrize("stage", [1, 2])
def test_expert_parallel_2_equals_one_rank(reference, stage):
    run = _run(2, _flags(**{"--zero-stage": stage, "--create-moe-param-group": True,
                            "--moe-expert-parallel-size": 2}))
    _same(run, reference)


def test_first_loss_is_the_builtin_layers_and_the_checkpoint_resumes(reference, tmp_path):
    builtin = _run(1, argv(**{"--num-experts": 4, "--topk": 2, "--lr-warmup-iters": 0}))
    assert math.isclose(builtin[0][0], reference[0][0], rel_tol=1e-6)
    save = str(tmp_path / "ckpt")
    common = {"--zero-stage": 1, "--create-moe-param-group": True,
              "--moe-expert-parallel-size": 2}
    first = _run(2, _flags(**common, **{"--train-iters": 3, "--save": save,
                                        "--save-interval": 3}))
    _same(first, reference[:3])
    resumed = _run(2, _flags(**common, **{"--load": save}))
    _same(resumed, reference[3:])
    # DeepSpeed-MoE's files (its experts each in a file of its own) convert to ours: the
    # built-in layer holding those weights continues with the same next loss.
    ours = str(tmp_path / "ours")
    assert convert.main(["--model-type", "GPT", "--loader", "deepspeed", "--saver", "megatron",
                         "--load-dir", save, "--save-dir", ours]) == 0
    builtin = _run(1, argv(**{"--num-experts": 4, "--topk": 2, "--load": ours,
                              "--no-load-optim": True, "--no-load-rng": True,
                              "--lr-warmup-iters": 0}))
    assert math.isclose(builtin[0][0], reference[3][0], rel_tol=1e-5)
