"""Megatron-LM torch_dist checkpoints of mixtures of experts both ways, against real
megatron-core 0.16.1 (tests/mcore_moe_checkpoint_driver.py, in a process of its own).

megatron-core's GPTModel with its local spec (SequentialMLP experts, 4 experts, top-2, the
auxiliary loss) is saved as Megatron-LM saves it at expert parallel 2: a GeLU model with
biases at tensor parallel 1 (experts of their own width in every layer: layers stacked, an
expert axis after theirs), and a Llama-spec one at tensor parallel 2 with a gated shared
expert, experts every other layer (megatron-core stores those layers unstacked) and
loss-free balancing's expert biases (``--moe-router-enable-expert-bias``). Ours
reads each with --use-checkpoint-args (megatron-core's MoE args) at expert parallel 1 and 2
and at tensor parallel 2 and gives its logits within 1e-5 (fp32), as does its conversion to
our format by ``convert.py --loader core``. megatron-core reads our checkpoints of those two
kinds and of the Llama-spec one with the shared expert in every layer (trained 2 iterations at
expert parallel 2 or tensor parallel 2, saved with --ckpt-format torch_dist) at expert
parallel 2 and gives our logits, as it does from one written again by the converter's
``core`` saver. A checkpoint whose routers learnt biases (megatron-core's, which ours lacks)
is refused by name. Ours saved at expert parallel 2 with the distributed optimizer resumes at
expert parallel 1 with the uninterrupted run's losses.
"""

from __future__ import annotations

import os

import pytest
import torch

import pretrain_gpt
from megatron.checkpointing import CheckpointError
from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.mcore_utils import (
    NEEDS_MCORE,
    load_run,
    run_mcore_driver,
    tensor_rank0_logits,
    train_losses,
)
from tests.distributed.training_utils import LLAMA_FLAGS, captured_stdout, flags_to_argv
from tools.checkpoint import convert

# About 90 s: three trainings, one megatron-core run on four ranks, seventeen loads; the only
# proof that MoE checkpoints of Megatron-LM's own code read and are read.
pytestmark = [pytest.mark.slow, NEEDS_MCORE]
SAVED_AT = 2
TRUE_VOCAB = 127  # the driver's: --vocab-size 126 and the end-of-document token; padded to 128
SHAPE = {"--num-layers": 4, "--hidden-size": 32, "--num-attention-heads": 4,
         "--seq-length": 16, "--max-position-embeddings": 16}
MOE = {"--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 48,
       "--moe-aux-loss-coeff": 0.01}
# The driver's two models (tests/mcore_moe_checkpoint_driver.py moe_args) in our flags, and
# the Llama-spec one with its gated shared expert in every layer (stacked; megatron-core has
# no shared expert with biases); the Llama-spec ones route by sigmoid with expert biases.
GELU = {**SHAPE, **MOE, "--ffn-hidden-size": 128}
SHARED = {**SHAPE, **MOE, **LLAMA_FLAGS, "--ffn-hidden-size": 64, "--norm-epsilon": 1e-6,
          "--rotary-base": 500000, "--moe-shared-expert-intermediate-size": 40,
          "--moe-shared-expert-gate": True, "--moe-router-score-function": "sigmoid",
          # expert biases that move enough in two steps to change which experts are chosen
          "--moe-router-enable-expert-bias": True, "--moe-router-bias-update-rate": 0.2}
SWIGLU = {**SHARED, "--moe-layer-freq": "[1,0,1,0]"}
RUN = {
    "--micro-batch-size": 1, "--global-batch-size": 2, "--lr": 3e-3, "--train-iters": SAVED_AT,
    "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--eval-iters": 0, "--num-workers": 0,
    "--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": TRUE_VOCAB - 1,
    "--make-vocab-size-divisible-by": 64, "--seed": 1234, "--use-cpu": True,
}
# Our trainings on two processes: (flags, layout flags).
OURS = {"ours_gelu": (GELU, {"--expert-model-parallel-size": 2}),
        "ours_swiglu": (SWIGLU, {"--tensor-model-parallel-size": 2}),
        "ours_shared": (SHARED, {"--expert-model-parallel-size": 2})}
# Our layouts on two processes: (tensor, expert) sizes.
LAYOUTS = {"ep1": (1, 1), "ep2": (1, 2), "tp2": (2, 1)}
MCORE = ("mcore_moe_gelu", "mcore_moe_swiglu")
# The checkpoints read at every layout (the others at expert parallel 2).
EVERY_LAYOUT = MCORE + ("ours_gelu", "ours_swiglu")


def _train_and_save(rank, world_size, out):
    for name, (flags, layout) in OURS.items():
        argv = flags_to_argv({**flags, **RUN, **layout, "--save": os.path.join(out, name),
                              "--save-interval": SAVED_AT, "--ckpt-format": "torch_dist"})
        with captured_stdout():
            pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                     pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
        parallel_state.destroy_model_parallel()


def _load(world, load: str, tp: int, ep: int):
    """``--use-checkpoint-args --load`` (weights only) at tensor size ``tp`` and expert size
    ``ep``: the model chunk."""
    argv = flags_to_argv({**RUN, "--use-checkpoint-args": True, "--load": load,
                          "--tensor-model-parallel-size": tp,
                          "--expert-model-parallel-size": ep, "--no-load-optim": True,
                          "--no-load-rng": True})
    _, chunks, _, _ = load_run(argv, world)
    return unwrap_model(chunks[0]).eval()


def _logits_after_load(world, load: str, tp: int, ep: int, tokens) -> torch.Tensor | None:
    """The logits ``[b, s, V]`` of ``tokens`` after ``_load``, on tensor rank 0."""
    model = _load(world, load, tp, ep)
    config = model.config
    assert (config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
            config.expert_model_parallel_size) == (4, 2, 48, ep)
    logits = tensor_rank0_logits(model, tokens)
    parallel_state.destroy_model_parallel()
    return logits


def _refusal(world, load: str) -> str:
    try:
        _load(world, load, 1, 1)
    except CheckpointError as error:
        return str(error)
    finally:
        parallel_state.destroy_model_parallel()
    return "no error"


def _loads(rank, world, folders: dict, refused: str, tokens) -> dict:
    """Per (layout, checkpoint), the logits this rank has (None where it has none): at every
    layout those of EVERY_LAYOUT, the others at expert parallel 2; the refusal's message."""
    out = {(layout, name): _logits_after_load(world, folder, tp, ep, tokens)
           for layout, (tp, ep) in LAYOUTS.items() for name, folder in folders.items()
           if layout == "ep2" or name in EVERY_LAYOUT}
    out["refused"] = _refusal(world, refused)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Our two checkpoints, megatron-core's, the conversions, the driver's moe_reference.pt
    and every load's logits."""
    ours = str(tmp_path_factory.mktemp("ours"))
    run_distributed(_train_and_save, 2, ours, timeout=600)
    out = str(tmp_path_factory.mktemp("mcore"))
    # Ours again through the converter's torch_dist saver (tp 1): megatron-core reads it.
    core_saved = os.path.join(out, "core_saved")
    assert convert.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "core",
                         "--load-dir", os.path.join(ours, "ours_gelu"),
                         "--save-dir", core_saved]) == 0
    ours_dirs = [os.path.join(ours, name, f"iter_{SAVED_AT:07d}") for name in OURS]
    run_mcore_driver(out, out, *ours_dirs, os.path.join(core_saved, f"iter_{SAVED_AT:07d}"),
                     script="mcore_moe_checkpoint_driver.py")  # its "ours": those, in order
    reference = torch.load(os.path.join(out, "moe_reference.pt"), weights_only=False)
    folders = {**{name: os.path.join(ours, name) for name in OURS},
               **{name: os.path.join(out, name) for name in MCORE}}
    # megatron-core's, read by the converter's core loader into our torch format.
    for name in MCORE:
        folders[f"{name}_converted"] = os.path.join(out, f"{name}_converted")
        assert convert.main(["--model-type", "GPT", "--loader", "core", "--saver", "megatron",
                             "--load-dir", folders[name], "--save-dir",
                             folders[f"{name}_converted"]]) == 0
    per_rank = run_distributed(_loads, 2, folders,
                               os.path.join(out, "mcore_moe_gelu_router_bias"),
                               reference["tokens"], timeout=600)
    loaded = {key: next((r[key] for r in per_rank if r[key] is not None), None)
              for key in per_rank[0]}
    return reference, loaded, per_rank, out


def _close(got, want, what: str, atol: float = 1e-5) -> None:
    got, want = got[..., :TRUE_VOCAB], want[..., :TRUE_VOCAB]
    print(f"{what}: max |difference|", (got - want).abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_core_moe_checkpoints_load_into_ours(checkpoints, layout):
    reference, loaded = checkpoints[:2]
    for name in MCORE:
        _close(loaded[(layout, name)], reference[name], f"{layout} <- {name}")


def test_the_converters_core_loader_reads_megatron_core_moe(checkpoints):
    reference, loaded = checkpoints[:2]
    for name in MCORE:
        _close(loaded[("ep2", f"{name}_converted")], reference[name],
               f"ep2 <- {name} converted to ours")


def test_our_moe_checkpoints_load_into_megatron_core(checkpoints):
    reference, loaded = checkpoints[:2]
    for name, got in zip(OURS, reference["ours"]):  # megatron-core at expert parallel 2
        for layout in LAYOUTS if name in EVERY_LAYOUT else ["ep2"]:
            _close(got, loaded[(layout, name)], f"megatron-core <- {name} vs ours at {layout}")


def test_the_converters_core_saver_writes_moe_megatron_core_reads(checkpoints):
    original, converted = checkpoints[0]["ours"][0], checkpoints[0]["ours"][len(OURS)]
    _close(converted, original, "megatron-core: converted vs original", atol=1e-6)


def test_learnt_router_biases_are_refused_by_name(checkpoints, tmp_path, capsys):
    """megatron-core's routers have a bias under --add-bias-linear, ours none: --load and
    the converter refuse a checkpoint whose router biases are not zero, in one line."""
    messages = {r["refused"] for r in checkpoints[2]}
    assert len(messages) == 1, messages  # every rank decides the same
    message = messages.pop()
    assert "routers have biases" in message and "--disable-bias-linear" in message, message
    assert convert.main(["--model-type", "GPT", "--loader", "core", "--saver", "megatron",
                         "--load-dir", os.path.join(checkpoints[3], "mcore_moe_gelu_router_bias"),
                         "--save-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "routers have biases" in err


# Resuming ours: saved at expert parallel 2 (each rank steps its two experts' state whole,
# the dense parameters' sharded over two data-parallel ranks), resumed at expert parallel 1
# (every expert's state sharded over the two ranks).
RESUME = {**GELU, **RUN, "--global-batch-size": 4, "--train-iters": 4, "--lr-warmup-iters": 1,
          "--min-lr": 3e-4, "--lr-decay-style": "cosine", "--clip-grad": 1.0,
          "--use-distributed-optimizer": True, "--moe-z-loss-coeff": 1e-3}


def _save_then_resume(rank, world_size, folder):
    run = train_losses(flags_to_argv({**RESUME, "--expert-model-parallel-size": 2,
                                      "--save": folder, "--save-interval": SAVED_AT,
                                      "--ckpt-format": "torch_dist"}))
    if rank == 0:  # resume from the middle of the run
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(SAVED_AT))
    torch.distributed.barrier()
    return run, train_losses(flags_to_argv({**RESUME, "--load": folder}))


def test_our_moe_torch_dist_resumes_at_another_expert_layout(tmp_path):
    """Model and optimizer state (each expert's moments, the router's) read at another
    expert layout: without the optimizer state iteration 4's loss differs (by 2e-3)."""
    run, resumed = run_distributed(_save_then_resume, 2, str(tmp_path / "ckpt"),
                                   timeout=600)[0]
    assert [it for it, _ in resumed] == [3, 4]
    print("uninterrupted", run, "resumed at expert parallel 1", resumed)
    for (_, got), (_, want) in zip(resumed, run[SAVED_AT:]):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, run)
