"""Megatron-LM torch_dist checkpoints of a Llama-spec model both ways, against real
megatron-core 0.16.1 (tests/mcore_driver.py --llama, in a process of its own).

megatron-core's GPTModel built with ``get_gpt_layer_local_spec(normalization="RMSNorm")``
(RMSNorm with epsilon 1e-6 and norm weights other than one, SwiGLU, 4 heads in 2 query groups,
RoPE with base 500000, untied, no biases) is saved as Megatron-LM saves it at tensor-parallel
sizes 1 and 2. Ours reads each with --use-checkpoint-args (no model flags) at tp 1 x dp 2, tp 2
and pp 2 and gives megatron-core's logits within 1e-5 (fp32); megatron-core reads our
checkpoint of the same options (trained 2 iterations at tp 2, saved with --ckpt-format
torch_dist) at tp 2 and gives our logits, as it does from that checkpoint written again by the
converter's ``core`` saver; the converter's ``core`` loader turns megatron-core's checkpoints
into Hugging Face Llama folders with megatron-core's logits.
"""

from __future__ import annotations

import os

import pytest
import torch

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import unwrap_model
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.mcore_utils import (
    NEEDS_MCORE,
    load_run,
    run_mcore_driver,
    tensor_rank0_logits,
)
from tests.distributed.training_utils import LLAMA_FLAGS, captured_stdout, flags_to_argv
from tools.checkpoint import convert

# About 30 s: one training, one megatron-core run, nine loads; the only proof that a
# Llama-spec checkpoint of Megatron-LM's own code reads and is read.
pytestmark = [pytest.mark.slow, NEEDS_MCORE]
SAVED_AT = 2
TRUE_VOCAB = 127  # the driver's: --vocab-size 126 and the end-of-document token; padded to 128
# The driver's model (tests/mcore_driver.py llama_args) in our flags.
FLAGS = {
    "--num-layers": 4, "--hidden-size": 32, "--num-attention-heads": 4, "--seq-length": 16,
    "--max-position-embeddings": 16, "--ffn-hidden-size": 64, "--norm-epsilon": 1e-6,
    "--rotary-base": 500000, **LLAMA_FLAGS,
}
RUN = {
    "--micro-batch-size": 1, "--global-batch-size": 2, "--lr": 3e-3, "--train-iters": SAVED_AT,
    "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--eval-iters": 0, "--num-workers": 0,
    "--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": TRUE_VOCAB - 1,
    "--make-vocab-size-divisible-by": 64, "--seed": 1234, "--use-cpu": True,
}
# Our layouts on two processes: (tensor, pipeline) sizes.
LAYOUTS = {"tp1dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _train_and_save(rank, world_size, save):
    argv = flags_to_argv({**FLAGS, **RUN, "--tensor-model-parallel-size": 2, "--save": save,
                          "--save-interval": SAVED_AT, "--ckpt-format": "torch_dist"})
    with captured_stdout():
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step, argv=argv)


def _load(world, load: str, tp: int, pp: int, **flags):
    """``--use-checkpoint-args --load`` at (tp, pp) with ``flags``: (config, chunks,
    optimizer)."""
    argv = flags_to_argv({**RUN, "--use-checkpoint-args": True, "--load": load,
                          "--tensor-model-parallel-size": tp,
                          "--pipeline-model-parallel-size": pp, **flags})
    cfg, chunks, optimizer, _ = load_run(argv, world)
    return cfg, chunks, optimizer


def _adam_difference_after_load(rank, world, load: str, reference: dict) -> dict:
    """Megatron-LM's default distributed-optimizer state of the Llama spec (saved at tp 2)
    read into our plain optimizer at tp 2 and our distributed one at tp 1 x dp 2: the
    largest difference from megatron-core's main weights and Adam moments, per layout."""
    from tests.distributed.test_torch_dist import _adam_differences

    out = {}
    for layout, tp, flags in (("tp2", 2, {}),
                              ("tp1dp2-distopt", 1, {"--use-distributed-optimizer": True})):
        cfg, chunks, optimizer = _load(world, load, tp, 1, **flags,
                                       **{"--use-checkpoint-opt_param-scheduler": True})
        out[layout] = _adam_differences(cfg, chunks, optimizer, reference)
        parallel_state.destroy_model_parallel()
    return out


def _logits_after_load(world, load: str, tp: int, pp: int, tokens) -> torch.Tensor | None:
    """``--use-checkpoint-args --load`` at (tp, pp) (weights only: megatron-core saved no
    optimizer), then the logits ``[b, s, V]`` of ``tokens`` on the rank that has them."""
    _, chunks, _ = _load(world, load, tp, pp, **{"--no-load-optim": True,
                                                 "--no-load-rng": True})
    model = unwrap_model(chunks[0]).eval()
    assert (model.config.normalization, model.config.swiglu, model.config.query_groups,
            model.config.layernorm_epsilon, model.config.rotary_base) == \
        ("RMSNorm", True, 2, 1e-6, 500000)
    logits = tensor_rank0_logits(model, tokens)
    parallel_state.destroy_model_parallel()
    return logits


def _loads(rank, world, folders: dict, tokens) -> dict:
    """Per layout and checkpoint, the logits this rank has (None where it has none)."""
    return {(layout, name): _logits_after_load(world, folder, tp, pp, tokens)
            for layout, (tp, pp) in LAYOUTS.items() for name, folder in folders.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Our checkpoint, megatron-core's two, and the driver's reference.pt."""
    ours = str(tmp_path_factory.mktemp("ours") / "ckpt")
    run_distributed(_train_and_save, 2, ours, timeout=600)
    out = str(tmp_path_factory.mktemp("mcore"))
    # Ours again through the converter's torch_dist saver (tp 1): megatron-core reads both.
    converted = os.path.join(out, "converted")
    assert convert.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "core",
                         "--load-dir", ours, "--save-dir", converted]) == 0
    run_mcore_driver(out, "--llama", out, *(os.path.join(d, f"iter_{SAVED_AT:07d}")
                                            for d in (ours, converted)))
    reference = torch.load(os.path.join(out, "reference.pt"), weights_only=False)
    folders = {"ours": ours, **{f"mcore_tp{tp}": os.path.join(out, f"mcore_llama_tp{tp}")
                                for tp in (1, 2)}}
    return folders, reference


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """``{(layout, checkpoint): logits}`` of ours at each of LAYOUTS."""
    folders, reference = checkpoints
    per_rank = run_distributed(_loads, 2, folders, reference["tokens"], timeout=600)
    return {key: next(r[key] for r in per_rank if r[key] is not None) for key in per_rank[0]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_core_llama_checkpoints_load_into_ours(checkpoints, loaded, layout):
    reference = checkpoints[1]
    for tp in (1, 2):
        got = loaded[(layout, f"mcore_tp{tp}")][..., :TRUE_VOCAB]
        want = reference[f"logits_tp{tp}"][..., :TRUE_VOCAB]
        print(f"{layout} <- megatron-core tp {tp}: max |difference|",
              (got - want).abs().max().item())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_our_llama_checkpoint_loads_into_megatron_core(checkpoints, loaded):
    got = checkpoints[1]["ours"][0]  # megatron-core's GPTModel at tp 2
    for layout in LAYOUTS:
        ours = loaded[(layout, "ours")]
        print(f"megatron-core vs ours at {layout}: max |difference|",
              (got - ours).abs().max().item())
        torch.testing.assert_close(got, ours, rtol=0, atol=1e-5)


def test_the_converters_torch_dist_saver_writes_a_llama_megatron_core_reads(checkpoints):
    original, converted = checkpoints[1]["ours"]  # megatron-core's logits from each
    print("megatron-core: converted vs original, max |difference|",
          (converted - original).abs().max().item())
    torch.testing.assert_close(converted, original, rtol=0, atol=1e-6)


def test_converter_reads_megatron_core_llama_into_hugging_face_llama(checkpoints, tmp_path):
    from transformers import LlamaForCausalLM

    folders, reference = checkpoints
    for tp in (1, 2):
        out = str(tmp_path / f"hf_tp{tp}")
        assert convert.main(["--model-type", "GPT", "--loader", "core", "--saver", "hf",
                             "--load-dir", folders[f"mcore_tp{tp}"], "--save-dir", out]) == 0
        model = LlamaForCausalLM.from_pretrained(out).eval()
        assert (model.config.num_key_value_heads, model.config.rms_norm_eps) == (2, 1e-6)
        with torch.no_grad():
            got = model(reference["tokens"]).logits[..., :TRUE_VOCAB]
        want = reference[f"logits_tp{tp}"][..., :TRUE_VOCAB]
        print(f"HF Llama <- megatron-core tp {tp}: max |difference|",
              (got - want).abs().max().item())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_megatron_lms_default_distributed_optimizer_state_of_a_llama_reads_exactly(
        checkpoints):
    """Its dp_reshardable buckets at tensor-parallel size 2, where each rank's fc1 state is
    its [gate_r; up_r] rows (two boxes of the global tensor), read by the converter into
    megatron-core's main weights and Adam moments exactly."""
    from megatron.checkpointing.formats.torch_dist.mcore_layout import full_places
    from megatron.conversion import load_full_checkpoint

    out = os.path.dirname(checkpoints[0]["mcore_tp1"])
    reference = torch.load(os.path.join(out, "llama_distopt_reference.pt"),
                           weights_only=False)["mcore_llama_distopt_tp2"]
    loaded = load_full_checkpoint(os.path.join(out, "mcore_llama_distopt_tp2"))
    assert loaded.optimizer["step"] == 1.0 and loaded.config["model"]["swiglu"]
    places = full_places({n: t.shape for n, t in loaded.model.items()},
                         loaded.config["model"]["num_layers"])
    fc1 = [n for n in loaded.optimizer["param_state"] if "dense_h_to_4h.weight" in n]
    assert fc1, sorted(loaded.optimizer["param_state"])
    for name, state in loaded.optimizer["param_state"].items():
        place = places[name]
        assert set(state) == {"param", "exp_avg", "exp_avg_sq"}
        for kind, tensor in state.items():
            offset, sizes = place.box((0,) * tensor.dim(), tuple(tensor.shape))
            box = tuple(slice(o, o + n) for o, n in zip(offset, sizes))
            want = reference[kind][place.key][box].reshape(tensor.shape)
            assert torch.equal(tensor, want), (name, kind)


def test_the_same_state_loads_into_our_optimizers_at_other_layouts(checkpoints):
    out = os.path.dirname(checkpoints[0]["mcore_tp1"])
    reference = torch.load(os.path.join(out, "llama_distopt_reference.pt"),
                           weights_only=False)["mcore_llama_distopt_tp2"]
    per_rank = run_distributed(_adam_difference_after_load, 2,
                               os.path.join(out, "mcore_llama_distopt_tp2"), reference,
                               timeout=600)
    for layout in ("tp2", "tp1dp2-distopt"):
        worst = max(r[layout] for r in per_rank)
        print(f"{layout} <- megatron-core's Llama distributed optimizer: max |difference|",
              worst)
        assert worst == 0.0
