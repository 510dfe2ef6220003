"""Real megatron-core (0.16.1, from PyPI) on CPU: writes Megatron-LM torch_dist checkpoints of
a small mixture-of-experts GPT and reads ours, for tests/distributed/test_torch_dist_moe.py.

Run isolated, as tests/mcore_driver.py is (``python -I tests/mcore_moe_checkpoint_driver.py
OUT [OUR_ITER_DIR ...]``: megatron-core's package is also named ``megatron``; see that
driver's docstring, whose CPU stand-ins and Megatron-LM save this one reuses). On four gloo
ranks it builds megatron-core's ``GPTModel`` with its local spec
(``get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)``: SequentialMLP experts,
top-2 routing with the auxiliary load-balancing loss) and saves it as Megatron-LM does:

1. ``OUT/mcore_moe_gelu``: expert parallel 2, tensor parallel 1 (expert-data parallel 2),
   GeLU experts with biases, LayerNorm, learned positions, tied embeddings, experts of their
   own width (``--moe-ffn-hidden-size``) in every layer;
2. ``OUT/mcore_moe_swiglu``: expert parallel 2 x tensor parallel 2, the Llama options
   (SwiGLU, RMSNorm, RoPE, untied, no biases), a gated shared expert
   (``--moe-shared-expert-intermediate-size``, ``--moe-shared-expert-gate``), experts every
   other layer (``--moe-layer-freq [1,0,1,0]``) and sigmoid routing with loss-free
   balancing's expert biases (``--moe-router-enable-expert-bias``, drawn);
3. loads each ``OUR_ITER_DIR`` (a torch_dist folder of ours) into the GPTModel its
   ``common.pt`` args describe, at expert parallel 2 x tensor parallel 2 (1 with biases);

(the all-gather token dispatcher: the all-to-all one makes CUDA streams), and writes
``OUT/moe_reference.pt``: the input tokens and every model's logits ``[b, s, V]``.
megatron-core's CPU initialisation draws the same experts on every expert-parallel rank, so
each expert's weights are then moved by an amount of its own (seeded by its global number):
a reader that mixed experts up would give other logits. megatron-core's routers have a
bias under --add-bias-linear and ours none: the GeLU model's are set to zero, after a save
with them as drawn (``OUT/mcore_moe_gelu_router_bias``).
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib

DRIVERS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, DRIVERS)  # tests/mcore_driver.py, which puts megatron-core first

import mcore_driver as base  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron.core import dist_checkpointing, tensor_parallel  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

EXPERTS, TOPK, MOE_FFN, SHARED_FFN = 4, 2, 48, 40
# (folder, expert-parallel size, tensor-parallel size, Llama options)
SAVES = (("mcore_moe_gelu", 2, 1, False), ("mcore_moe_swiglu", 2, 2, True))


def moe_args(ep: int, tp: int, llama: bool, iteration: int) -> argparse.Namespace:
    """Megatron-LM's args of the two models (see the module docstring)."""
    if llama:
        args = base.llama_args(tp, iteration)
        vars(args).update(moe_shared_expert_intermediate_size=SHARED_FFN,
                          moe_shared_expert_gate=True, moe_layer_freq=[1, 0, 1, 0],
                          moe_router_score_function="sigmoid",
                          moe_router_enable_expert_bias=True)
    else:
        args = base.megatron_args(tp, tied=True, fused_gelu=False, iteration=iteration)
        vars(args).update(moe_shared_expert_intermediate_size=None,
                          moe_shared_expert_gate=False, moe_layer_freq=1,
                          moe_router_score_function="softmax",
                          moe_router_enable_expert_bias=False)
    vars(args).update(
        num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=None, moe_router_pre_softmax=False, moe_expert_capacity_factor=None,
        moe_token_drop_policy="probs", moe_pad_expert_input_to_capacity=False,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
    return args


def build_moe_model(args: argparse.Namespace) -> GPTModel:
    """megatron-core's GPTModel of Megatron-LM's MoE args, as its ``pretrain_gpt.py`` builds
    it with ``--transformer-impl local``: ``get_gpt_decoder_block_spec`` gives each layer
    ``get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)`` or the dense one,
    per ``moe_layer_freq``)."""
    config = TransformerConfig(
        **base.transformer_config_fields(args), bias_activation_fusion=False,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_layer_freq=args.moe_layer_freq,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=False,
        pipeline_model_parallel_size=1)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=config.normalization)
    tied = not args.untie_embeddings_and_output_weights
    return GPTModel(config, spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=tied,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=getattr(args, "rotary_percent", 1.0),
                    rotary_base=getattr(args, "rotary_base", 10000),
                    rope_scaling=getattr(args, "use_rope_scaling", False))


def distinct_experts(model: GPTModel) -> None:
    """Each expert's weights moved by noise seeded by its layer, global number, name and
    tensor rank (see the module docstring); replicated tensors stay the same on every rank
    that holds them (experts' biases exist at tensor-parallel size 1 only)."""
    per_rank = EXPERTS // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * per_rank
    tp_rank = ps.get_tensor_model_parallel_rank()
    for name, param in model.named_parameters():
        if ".local_experts." not in name:
            continue
        head, rest = name.split(".local_experts.")
        local, tail = rest.split(".", 1)
        seed = zlib.crc32(f"{head}.{first + int(local)}.{tail}.{tp_rank}".encode())
        g = torch.Generator().manual_seed(seed)
        param.data.add_(torch.randn(param.shape, generator=g) * 0.05)


def drawn_expert_biases(model: GPTModel) -> None:
    """Loss-free balancing's expert biases (zero as built) drawn by layer: large enough to
    change which experts the sigmoid scores choose, the same on every rank."""
    for name, buffer in model.named_buffers():
        if name.endswith("mlp.router.expert_bias"):
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            buffer.copy_(torch.randn(buffer.shape, generator=g) * 0.5)


def zero_router_biases(model: GPTModel) -> None:
    """megatron-core's routers have a bias under --add-bias-linear, ours none (a zero one):
    the checkpoint ours reads has them at zero."""
    for name, param in model.named_parameters():
        if name.endswith("mlp.router.bias"):
            param.data.zero_()


def save_moe(out: str, folder: str, ep: int, tp: int, llama: bool) -> torch.Tensor:
    """One of SAVES: built, saved as Megatron-LM does, and its logits. The GeLU model is
    also saved with its routers' biases as drawn (``OUT/<folder>_router_bias``: ours
    refuses it) before they are set to zero."""
    args = moe_args(ep, tp, llama, iteration=10 * tp)
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=tp)
    torch.manual_seed(100 + tp)
    model = build_moe_model(args)
    base.scale_norm_weights(model)
    distinct_experts(model)
    drawn_expert_biases(model)
    if args.add_bias_linear:
        base.save_like_megatron_lm(os.path.join(out, f"{folder}_router_bias"), model, args)
        zero_router_biases(model)
    base.save_like_megatron_lm(os.path.join(out, folder), model, args)
    result = base.logits(model)
    ps.destroy_model_parallel()
    return result


def load_ours(iter_dir: str) -> torch.Tensor:
    """Our torch_dist checkpoint read by megatron-core into its GPTModel at expert parallel 2
    and tensor parallel 2 (1 with biases: megatron-core's experts have biases only without
    expert tensor parallelism)."""
    common = torch.load(os.path.join(iter_dir, "common.pt"), weights_only=False)
    args = common["args"]
    tp = 1 if args.add_bias_linear else 2
    vars(args).update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                      expert_model_parallel_size=2, expert_tensor_parallel_size=tp)
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=tp)
    model = build_moe_model(args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
    model.load_state_dict(state["model"])
    result = base.logits(model)
    ps.destroy_model_parallel()
    return result


def _stand_in_for_cuda() -> None:
    """tests/mcore_driver.py's CPU stand-ins, for megatron-core's MoE modules too (its router
    moves its weight to ``torch.cuda.current_device()``). Without Transformer Engine its
    router's product names ``te_general_gemm``, which only TE's import defines: None is what
    its plain torch path tests for."""
    import importlib

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    base._stand_in_for_cuda()
    for name in ("transformer.moe.router", "transformer.moe.moe_utils",
                 "transformer.moe.token_dispatcher", "transformer.moe.experts",
                 "transformer.moe.moe_layer", "transformer.moe.shared_experts",
                 "tensor_parallel.mappings"):
        module = importlib.import_module(f"megatron.core.{name}")
        module.torch = base._TorchForMcoreOnCpu("torch")


def _run(rank: int, world: int, port: int, out: str, ours: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _stand_in_for_cuda()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    result = {"tokens": base.TOKENS}
    for folder, ep, tp, llama in SAVES:
        result[folder] = save_moe(out, folder, ep, tp, llama)
    result["ours"] = [load_ours(d) for d in ours]
    if rank == 0:
        torch.save(result, os.path.join(out, "moe_reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    out, ours = sys.argv[1], sys.argv[2:]
    base.start_ranks(_run, (4, base._free_port(), out, ours), 4)


if __name__ == "__main__":
    main()
