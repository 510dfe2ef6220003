"""Real megatron-core (from PyPI) on CPU: writes Megatron-LM torch_dist checkpoints of a small
GPT and reads ours, for tests/distributed/test_torch_dist.py.

megatron-core is not installed into the environment: its package is also named ``megatron``
and would shadow this repository's in every process whose path lacks the checkout. The test
install puts it in a folder of its own, ``.test-deps/megatron-core`` in the checkout (README
"Run the tests": ``pip install --no-deps --upgrade --target .test-deps/megatron-core
megatron-core==0.16.1``; ``$MEGATRON_CORE_DIR`` names another folder), which this driver alone
puts first on its path. Run it isolated (``python -I tests/mcore_driver.py OUT
[OUR_ITER_DIR ...]``: no PYTHONPATH, no script folder on the path), so that ``megatron`` is
megatron-core's package, not this repository's. On two gloo ranks it

1. builds megatron-core's ``GPTModel`` (local layer spec) at tensor-parallel size 1 (two
   data-parallel replicas; tied embeddings, Megatron-LM's default fused bias-GeLU = GeLU's
   tanh form), takes one Adam step with megatron-core's optimizer checkpoint helpers and saves it as
   Megatron-LM's ``save_checkpoint`` does (``generate_state_dict``'s entries through
   ``dist_checkpointing.save``, the tracker file) to ``OUT/mcore_tp1``;
2. the same at tensor-parallel size 2 with untied embeddings and the plain erf GeLU
   (``--no-bias-gelu-fusion``), model only, to ``OUT/mcore_tp2``;
3. loads each ``OUR_ITER_DIR`` (a torch_dist iteration folder of ours) into a megatron-core
   ``GPTModel`` at tensor-parallel size 2 with ``dist_checkpointing.load``;

and writes ``OUT/reference.pt``: the input tokens, every model's logits ``[b, s, V]`` on them
and the Adam state of step 1. Then, on four ranks (data-parallel size 2), it

4. wraps the model in megatron-core's DDP and distributed optimizer at tensor x pipeline
   2 x 1 and 1 x 2, takes one step on set gradients and saves as Megatron-LM does by default
   (the optimizer state in its ``dp_reshardable`` buckets) to ``OUT/mcore_distopt_*``, with
   the state by checkpoint name in ``OUT/distopt_reference.pt``.

``python -I tests/mcore_driver.py --llama OUT [OUR_ITER_DIR ...]`` does steps 1-3 alone for a
Llama-spec model instead (Megatron-LM's Llama flags: ``--normalization RMSNorm --swiglu
--group-query-attention --num-query-groups 2 --position-embedding-type rope
--untie-embeddings-and-output-weights --disable-bias-linear``; ``get_gpt_layer_local_spec``
with RMSNorm; norm epsilon 1e-6, RoPE base 500000 and norm weights other than one, so that
each is seen), model only at tensor-parallel sizes 1 and 2 (``OUT/mcore_llama_tp{1,2}``),
and loads ours into it at tensor-parallel size 2; its ``OUT/reference.pt`` has the same
entries less ``adam_tp1``. Step 4 then runs the Llama spec at tensor x pipeline 2 x 1
(``OUT/mcore_llama_distopt_tp2``, the state in ``OUT/llama_distopt_reference.pt``).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import types
import warnings
import zlib
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MCORE_DIR = os.environ.get("MEGATRON_CORE_DIR") or os.path.join(REPO, ".test-deps",
                                                                  "megatron-core")
sys.path.insert(0, MCORE_DIR)

import megatron.core  # noqa: E402 - megatron-core's, see the module docstring

if not hasattr(megatron.core, "dist_checkpointing"):
    sys.exit(f"error: 'megatron' is {megatron.__path__}, not megatron-core's package (install "
             f"it into {MCORE_DIR}: pip install --no-deps --upgrade --target {MCORE_DIR} "
             "megatron-core==0.16.1)")

from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.enums import AttnBackend  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron.core import dist_checkpointing, tensor_parallel  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.optimizer.optimizer import FP32Optimizer  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 4, 32, 4, 16, 128  # VOCAB: padded for tp 1 and tp 2
TRUE_VOCAB = 127  # NullTokenizer's --vocab-size 126 plus its end-of-document token
LLAMA_FFN, LLAMA_GROUPS = 64, 2  # SwiGLU width (8/3 x 32 rounded down to 64); kv heads
TOKENS = torch.randint(0, TRUE_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _on_cpu(kwargs: dict) -> dict:
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = "cpu"
    return kwargs


class _CudaOnCpu:
    """megatron-core calls torch.cuda.synchronize() and torch.cuda.current_device()
    unconditionally (its torch_dist save; the local attention's scratch buffer; its gradient
    buffers), and torch.cuda.empty_cache() in its optimizer; on a CPU-only torch these stand
    in, for megatron-core's modules only (the rest of torch.cuda stays torch's)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(*args):
        return None

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def empty_cache():
        return None


class _TorchForMcoreOnCpu(types.ModuleType):
    """``torch`` as megatron-core's modules see it: the stand-ins above, and the tensors its
    optimizer creates with ``device="cuda"`` made on the CPU."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, **kwargs):
        return torch.tensor(*args, **_on_cpu(kwargs))

    @staticmethod
    def zeros(*args, **kwargs):
        return torch.zeros(*args, **_on_cpu(kwargs))

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **_on_cpu(kwargs))


def _stand_in_for_cuda() -> None:
    import importlib

    for name in ("megatron.core.dist_checkpointing.strategies.filesystem_async",
                 "megatron.core.dist_checkpointing.strategies.state_dict_saver",
                 "megatron.core.utils", "megatron.core.distributed.param_and_grad_buffer",
                 "megatron.core.distributed.distributed_data_parallel",
                 "megatron.core.optimizer", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.distrib_optimizer",
                 "megatron.core.optimizer.clip_grads",
                 "megatron.core.models.common.embeddings.rotary_pos_embedding"):
        importlib.import_module(name).torch = _TorchForMcoreOnCpu("torch")


def _tensors_as_if_on_cuda() -> None:
    """megatron-core's distributed optimizer accepts only parameters whose ``type()`` is a
    ``torch.cuda.*Tensor`` and moves tied embeddings with ``.cuda()``. This process runs
    megatron-core's code alone (none of ours), so its CPU tensors answer as CUDA ones and
    ``.cuda()`` leaves them where they are."""
    plain_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return plain_type(self, *args, **kwargs)
        return plain_type(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def megatron_args(tp: int, tied: bool, fused_gelu: bool, iteration: int) -> argparse.Namespace:
    """The model's entries of Megatron-LM's args, as its arguments.py names them."""
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
        num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS, group_query_attention=False,
        num_query_groups=1, seq_length=SEQ, max_position_embeddings=SEQ,
        padded_vocab_size=VOCAB, vocab_size=TRUE_VOCAB - 1, make_vocab_size_divisible_by=64,
        norm_epsilon=1e-5, normalization="LayerNorm", hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02,
        untie_embeddings_and_output_weights=not tied, position_embedding_type="learned_absolute",
        add_bias_linear=True, bias_gelu_fusion=fused_gelu, openai_gelu=False, swiglu=False,
        fp16=False, bf16=False, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1, use_distributed_optimizer=False, ckpt_format="torch_dist",
        tokenizer_type="NullTokenizer", iteration=iteration, consumed_train_samples=8 * iteration,
        consumed_valid_samples=0, attention_backend=AttnBackend.auto, transformer_impl="local",
        data_parallel_random_init=False)


def llama_args(tp: int, iteration: int) -> argparse.Namespace:
    """Megatron-LM's args for its Llama flags (see the module docstring), model only."""
    args = megatron_args(tp, tied=False, fused_gelu=False, iteration=iteration)
    vars(args).update(
        ffn_hidden_size=LLAMA_FFN, group_query_attention=True, num_query_groups=LLAMA_GROUPS,
        norm_epsilon=1e-6, normalization="RMSNorm", swiglu=True, bias_swiglu_fusion=False,
        position_embedding_type="rope", add_position_embedding=False, rotary_percent=1.0,
        rotary_base=500000, rotary_interleaved=False, use_rope_scaling=False,
        add_bias_linear=False, add_qkv_bias=False)
    return args


def transformer_config_fields(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields Megatron-LM's args give a dense local-spec model on a CPU
    (dropout off, no fusions, weights made on the CPU)."""
    swiglu = getattr(args, "swiglu", False)
    return dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels, layernorm_epsilon=args.norm_epsilon,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=args.init_method_std,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=getattr(args, "add_qkv_bias", False),
        activation_func=F.silu if swiglu else F.gelu, gated_linear_unit=swiglu,
        normalization=getattr(args, "normalization", "LayerNorm"),
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        rotary_interleaved=getattr(args, "rotary_interleaved", False), apply_rope_fusion=False,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        use_cpu_initialization=True, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_query_key_layer_scaling=False, pipeline_dtype=torch.float32)


def build_model(args: argparse.Namespace, pre_process: bool = True,
                post_process: bool = True) -> GPTModel:
    """megatron-core's GPTModel from Megatron-LM's args, as its ``pretrain_gpt.py`` builds it
    with ``--transformer-impl local`` (``core_transformer_config_from_args``: SwiGLU is
    ``gated_linear_unit`` with SiLU; query groups only with ``--group-query-attention``)."""
    swiglu = getattr(args, "swiglu", False)
    config = TransformerConfig(
        **transformer_config_fields(args),
        bias_activation_fusion=args.bias_gelu_fusion and not swiglu,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    return GPTModel(config, spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=getattr(args, "rotary_percent", 1.0),
                    rotary_base=getattr(args, "rotary_base", 10000),
                    rope_scaling=getattr(args, "use_rope_scaling", False))


def scale_norm_weights(model: GPTModel) -> None:
    """Norm weights other than megatron-core's initial ones, the same on every tensor rank
    (they are replicated), so that a reader mixing up the norms is seen."""
    for name, param in model.named_parameters():
        if "layernorm" in name:
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            param.data.uniform_(0.5, 1.5, generator=g)


def logits(model: GPTModel) -> torch.Tensor:
    """``[b, s, V]`` of TOKENS, causal attention, eval mode."""
    model.eval()
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True: masked out
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(TOKENS)
    with torch.no_grad():
        return gather_vocab(model(TOKENS, positions, mask)).detach().clone()


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """``[b, s, V/tp]`` of each tensor rank -> ``[b, s, V]``."""
    group = ps.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def adam_step(model: GPTModel) -> torch.optim.Adam:
    """One Adam step on a language-model loss."""
    model.train()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(TOKENS)
    out = model(TOKENS, positions, mask)  # [b, s, V] (tensor-parallel size 1)
    loss = F.cross_entropy(out.flatten(0, 1).float(), TOKENS.roll(-1, 1).flatten())
    loss.backward()
    adam.step()
    return adam


def adam_by_checkpoint_name(adam: torch.optim.Adam, model: GPTModel) -> dict:
    """``{kind: {key: global tensor}}``: Adam's moments under the checkpoint's tensor names
    (layer-stacked), as one rank at tensor-parallel size 1 holds them."""
    out = {"exp_avg": {}, "exp_avg_sq": {}}
    for sh in nested_values(model.sharded_state_dict()):
        if not isinstance(sh, ShardedTensor) or sh.data not in adam.state:
            continue
        sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        box = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sizes))
        for kind, full in out.items():
            target = full.setdefault(sh.key, torch.zeros(sh.global_shape))
            target[box] = adam.state[sh.data][kind].view(sizes)
    return out


def optimizer_sharded_state(adam: torch.optim.Adam, model_sd: dict) -> dict:
    """megatron-core's FP32Optimizer.sharded_state_dict, step for step, through its own
    dist_checkpointing.optimizer helpers (the class itself allocates on CUDA when built)."""
    state = adam.state_dict()
    params = chain.from_iterable(g["params"] for g in adam.param_groups)
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    step = FP32Optimizer._extract_common_per_param_step(state)
    optim_state_to_sharding_state(state, id_map, exclude_keys="step")
    state["state"]["common_step"] = step
    return state


def scheduler_state(iteration: int) -> dict:
    """Megatron-LM's OptimizerParamScheduler.state_dict() for --lr 3e-3 --min-lr 3e-4
    --lr-warmup-iters 2 --lr-decay-style cosine, 6 iterations of 4 samples (steps count
    samples)."""
    return {"max_lr": 3e-3, "lr_warmup_steps": 8, "num_steps": 8 * iteration,
            "lr_decay_style": "cosine", "lr_decay_steps": 24, "min_lr": 3e-4, "start_wd": 0.01,
            "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 24}


def rng_state() -> dict:
    """Megatron-LM's get_rng_state entry. Its CUDA generators cannot be read on a CPU-only
    torch: 16-byte Philox states of the shape a GPU run stores stand in for them."""
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
            "rng_tracker_states": {"model-parallel-rng": torch.ones(16, dtype=torch.uint8)}}


def save_like_megatron_lm(root: str, model: GPTModel, args: argparse.Namespace,
                          optimizer=None, distributed_optimizer=None) -> None:
    """Megatron-LM's save_checkpoint for --ckpt-format torch_dist: generate_state_dict's
    entries, dist_checkpointing.save into iter_XXXXXXX, then the tracker file. A
    ``distributed_optimizer`` (megatron-core's) is saved in Megatron-LM's default
    dp_reshardable form."""
    iteration = args.iteration
    folder = os.path.join(root, f"iter_{iteration:07d}")
    model_sd = model.sharded_state_dict()
    content_metadata = {"distrib_optim_sharding_type": "dp_reshardable",
                        "chained_optim_avoid_prefix": True}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model_sd,
             "num_floating_point_operations_so_far": 1234.0,
             "opt_param_scheduler": scheduler_state(iteration),
             "rng_state": ShardedObject(
                 "rng_state", [rng_state()],
                 (ps.get_pipeline_model_parallel_world_size(),
                  ps.get_tensor_model_parallel_world_size()),
                 (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                 replica_id=ps.get_data_parallel_rank())}
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state(optimizer, model_sd)
    if distributed_optimizer is not None:
        state["optimizer"] = distributed_optimizer.sharded_state_dict(
            model_sd, metadata=content_metadata)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, folder, content_metadata=content_metadata
                            if distributed_optimizer is not None else None)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def load_ours(iter_dir: str) -> torch.Tensor:
    """Our torch_dist checkpoint read by megatron-core into its GPTModel at tp 2."""
    common = torch.load(os.path.join(iter_dir, "common.pt"), weights_only=False)
    args = common["args"]
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = 2, 1
    model = build_model(args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
    model.load_state_dict(state["model"])
    return logits(model)


def _saves(llama: bool) -> list[tuple[str, argparse.Namespace]]:
    """(folder, args) of the checkpoints megatron-core saves: GPT's at tp 1 (tied, fused
    bias-GeLU; with Adam's state) and tp 2 (untied, erf GeLU), or the Llama spec's at both."""
    if llama:
        return [(f"mcore_llama_tp{tp}", llama_args(tp, iteration=10 * tp)) for tp in (1, 2)]
    return [("mcore_tp1", megatron_args(1, tied=True, fused_gelu=True, iteration=10)),
            ("mcore_tp2", megatron_args(2, tied=False, fused_gelu=False, iteration=20))]


def _run(rank: int, world: int, port: int, out: str, ours: list[str], llama: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _stand_in_for_cuda()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # megatron-core's inference generator tracker: attention dropout (p = 0 here) forks no
    # CUDA generator.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    result = {"tokens": TOKENS}
    for folder, args in _saves(llama):
        tp = args.tensor_model_parallel_size
        ps.initialize_model_parallel(tp, 1)
        torch.manual_seed(100 + tp)
        model = build_model(args)
        if llama:
            scale_norm_weights(model)
        optimizer = adam_step(model) if folder == "mcore_tp1" else None
        save_like_megatron_lm(os.path.join(out, folder), model, args, optimizer)
        result[f"logits_tp{tp}"] = logits(model)
        if optimizer is not None:
            result["adam_tp1"] = adam_by_checkpoint_name(optimizer, model)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1)
    result["ours"] = [load_ours(d) for d in ours]
    if rank == 0:
        torch.save(result, os.path.join(out, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


# megatron-core's distributed optimizer, saved in Megatron-LM's default dp_reshardable form:
# (tensor, pipeline) sizes on 4 ranks (data-parallel size 2), tied embeddings. Small buckets,
# so that a rank holds several and parameters straddle the data-parallel shards.
DISTOPT_LAYOUTS = {"mcore_distopt_tp2": (2, 1), "mcore_distopt_pp2": (1, 2)}
# With --llama: the Llama spec at tensor-parallel size 2, whose buckets hold each rank's
# SwiGLU [gate_r; up_r] rows (two boxes of the global fc1).
LLAMA_DISTOPT_LAYOUTS = {"mcore_llama_distopt_tp2": (2, 1)}
DISTOPT_ITERATION = 7
BUCKET_SIZE = 3000


def _sharded_tensors(model: GPTModel) -> dict:
    """Each parameter's ShardedTensor (its checkpoint name and global place)."""
    return {sh.data: sh for sh in nested_values(model.sharded_state_dict())
            if isinstance(sh, ShardedTensor)}


def _sharded_pieces(model: GPTModel) -> dict:
    """Each parameter's ShardedTensors: one, or for SwiGLU's fc1 (a ShardedTensorFactory at
    tensor-parallel size > 1) the gate rows and the up rows, in the local tensor's order."""
    pieces = {}
    for sh in nested_values(model.sharded_state_dict()):
        if isinstance(sh, ShardedTensor):
            pieces[sh.data] = [sh]
        elif isinstance(sh, ShardedTensorFactory):
            pieces[sh.data] = list(nested_values(sh.build()))
    return pieces


def _fill_gradients(model: GPTModel) -> None:
    """Gradients that depend only on a parameter's checkpoint name and place, so replicas
    (over data and tensor parallelism, and the last stage's tied embeddings) agree, as
    their reduced gradients do in training."""
    for param, sh in _sharded_tensors(model).items():
        seed = zlib.crc32(f"{sh.key}{tuple(sh.global_offset)}".encode())
        g = torch.Generator().manual_seed(seed)
        param.main_grad.copy_(torch.randn(param.shape, generator=g) * 0.01)


def distopt_state_by_checkpoint_name(optimizer, model: GPTModel) -> dict:
    """``{kind: {key: global tensor}}``: the distributed optimizer's fp32 main weights and
    Adam moments under the checkpoint's tensor names, assembled on rank 0 from every rank's
    shards (what a model-space reader must produce)."""
    pieces = []
    for param, shs in _sharded_pieces(model).items():
        # The optimizer knows only the parameters of which this rank steps a part.
        owners = [o for o in optimizer.chained_optimizers if param in o.model_param_gbuf_map]
        if not owners:
            continue
        inner = owners[0]
        gbuf, dtype, bucket = inner.model_param_gbuf_map[param]
        rng = inner.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]["param"]
        state = inner._get_main_param_and_optimizer_states(param)
        boxes = [(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                  (1,) * sh.prepend_axis_num + tuple(sh.local_shape)) for sh in shs]
        pieces.append((boxes, rng.start, rng.end,
                       {k: state[k].detach().clone() for k in ("param", "exp_avg", "exp_avg_sq")}))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    out = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for boxes, lo, hi, state in chain.from_iterable(gathered):
        for kind, value in state.items():
            # The local tensor is the pieces' boxes one after another (flattened).
            views = []
            for key, global_shape, offset, sizes in boxes:
                full = out[kind].setdefault(key, torch.zeros(global_shape))
                views.append((full, tuple(slice(o, o + n) for o, n in zip(offset, sizes)),
                              sizes))
            local = torch.cat([full[box].reshape(-1) for full, box, _ in views])
            local[lo:hi] = value
            start = 0
            for full, box, sizes in views:
                n = int(np.prod(sizes))
                full[box] = local[start:start + n].view(sizes)
                start += n
    return out


def _distributed_optimizer_run(rank: int, world: int, port: int, out: str,
                               llama: bool = False) -> None:
    """Per DISTOPT_LAYOUTS (LLAMA_DISTOPT_LAYOUTS): megatron-core's DDP and distributed optimizer (its Adam falls
    back to torch's AdamW without Transformer Engine or Apex), one step on set gradients,
    Megatron-LM's save; the state by checkpoint name into ``OUT/distopt_reference.pt``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _stand_in_for_cuda()
    _tensors_as_if_on_cuda()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    reference = {}
    for name, (tp, pp) in (LLAMA_DISTOPT_LAYOUTS if llama else DISTOPT_LAYOUTS).items():
        ps.initialize_model_parallel(tp, pp)
        torch.manual_seed(300 + tp)
        args = (llama_args(tp, iteration=DISTOPT_ITERATION) if llama else
                megatron_args(tp, tied=True, fused_gelu=True, iteration=DISTOPT_ITERATION))
        args.pipeline_model_parallel_size, args.use_distributed_optimizer = pp, True
        model = build_model(args, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE),
            model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
        _fill_gradients(model)
        optimizer.step()
        save_like_megatron_lm(os.path.join(out, name), model, args,
                              distributed_optimizer=optimizer)
        reference[name] = distopt_state_by_checkpoint_name(optimizer, model)
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save(reference, os.path.join(out, "llama_distopt_reference.pt" if llama
                                           else "distopt_reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(fn, args: tuple, ranks: int) -> None:
    """``fn(rank, *args)`` on ``ranks`` processes forked from this one (which has imported
    torch and megatron-core and does nothing else: a spawned rank would import them again,
    seconds of CPU each)."""
    torch.multiprocessing.start_processes(fn, args=args, nprocs=ranks, start_method="fork")


def main() -> None:
    llama = sys.argv[1:2] == ["--llama"]
    out, ours = sys.argv[1 + llama], sys.argv[2 + llama:]
    start_ranks(_run, (2, _free_port(), out, ours, llama), 2)
    start_ranks(_distributed_optimizer_run, (4, _free_port(), out, llama), 4)


if __name__ == "__main__":
    main()
