"""Real megatron-core for the torch_dist tests: where tests/mcore_driver.py finds it, the skip
when it is absent, and the driver's run (isolated: megatron-core's package is also named
``megatron``; see the driver's docstring); and, for our side inside a gloo rank, a quiet
``--load``, a quiet training run and the logits of a loaded model."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE_DIR = os.environ.get("MEGATRON_CORE_DIR") or os.path.join(REPO, ".test-deps",
                                                                  "megatron-core")
HAVE_MCORE = any(importlib.metadata.distributions(name="megatron-core", path=[MCORE_DIR]))
NEEDS_MCORE = pytest.mark.skipif(
    not HAVE_MCORE, reason=f"megatron-core is not in {MCORE_DIR} (README's test command "
    f"installs it there: pip install --no-deps --upgrade --target {MCORE_DIR} "
    "megatron-core==0.16.1)")


def run_mcore_driver(out: str, *args: str, script: str = "mcore_driver.py") -> None:
    """``python -I tests/<script> *args`` in ``out`` (no PYTHONPATH: its ``megatron`` is
    megatron-core's); fails the test with the driver's output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", os.path.join(REPO, "tests", script),
                           *args], cwd=out, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


# ------------------------------------------------------------------ ours, in a gloo rank


def load_run(argv: list[str], world: int):
    """Our model and optimizer built from ``argv`` (with ``--use-checkpoint-args``: the
    checkpoint's settings) and ``--load`` done quietly: (config, chunks, optimizer, what
    load_checkpoint returned)."""
    import pretrain_gpt
    from megatron.assembly.build import (
        RunContext,
        build_run_tokenizer,
        setup_model_and_optimizer,
    )
    from megatron.assembly.initialize import initialize_megatron
    from megatron.checkpointing import checkpoint_model_settings, load_checkpoint
    from megatron.config import parse_args
    from tests.distributed.training_utils import captured_stdout

    cfg = parse_args(argv, world_size=world, checkpoint_settings=checkpoint_model_settings)
    cfg = cfg.with_vocab_size(build_run_tokenizer(cfg).vocab_size)
    device = initialize_megatron(cfg)
    chunks, optimizer, scheduler = setup_model_and_optimizer(
        pretrain_gpt.model_provider, RunContext(cfg, device=device))
    with captured_stdout():
        loaded = load_checkpoint(chunks, optimizer, scheduler, cfg)
    return cfg, chunks, optimizer, loaded


def tensor_rank0_logits(model, tokens):
    """The logits ``[b, s, V]`` of ``tokens`` on tensor-parallel rank 0 of the last stage
    (None on the other ranks)."""
    import torch

    from megatron.core import parallel_state
    from megatron.inference.text_generation.forward import forward_logits

    with torch.no_grad():
        logits = forward_logits(model, tokens, None, all_positions=True)
    if logits is None or parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    return logits.detach().clone()


def train_losses(argv: list[str]) -> list[tuple[int, float]]:
    """(iteration, lm loss) of each logged step of a quiet run of ``argv``; the model-parallel
    state is torn down after it, so the rank can run again."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import pretrain
    from tests.distributed.training_utils import captured_stdout

    with captured_stdout():
        state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                         pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    parallel_state.destroy_model_parallel()
    return [(h["iteration"], h["losses"]["lm loss"]) for h in state.history if h["losses"]]
