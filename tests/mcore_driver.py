"""Real megatron-core (from PyPI) on CPU: writes Megatron-LM torch_dist checkpoints of a small
GPT and reads ours, for tests/functional/test_torch_dist_megatron_core.py.

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
and the Adam state of step 1.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import types
import warnings
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
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
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
TOKENS = torch.randint(0, TRUE_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


class _CudaOnCpu:
    """megatron-core calls torch.cuda.synchronize() and torch.cuda.current_device()
    unconditionally (its torch_dist save; the local attention's scratch buffer); on a CPU-only
    torch these two stand in, for megatron-core's modules only (the rest of torch.cuda stays
    torch's)."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(*args):
        return None

    @staticmethod
    def current_device():
        return "cpu"


class _TorchForMcoreOnCpu(types.ModuleType):
    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)


def _stand_in_for_cuda() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver

    from megatron.core import utils

    for module in (filesystem_async, state_dict_saver, utils):
        module.torch = _TorchForMcoreOnCpu("torch")


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


def build_model(args: argparse.Namespace) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels, layernorm_epsilon=args.norm_epsilon,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=args.init_method_std,
        add_bias_linear=args.add_bias_linear, bias_activation_fusion=args.bias_gelu_fusion,
        activation_func=F.gelu, tensor_model_parallel_size=args.tensor_model_parallel_size,
        use_cpu_initialization=True, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_query_key_layer_scaling=False, pipeline_dtype=torch.float32)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type)


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
                          optimizer=None) -> None:
    """Megatron-LM's save_checkpoint for --ckpt-format torch_dist: generate_state_dict's
    entries, dist_checkpointing.save into iter_XXXXXXX, then the tracker file."""
    iteration = args.iteration
    folder = os.path.join(root, f"iter_{iteration:07d}")
    model_sd = model.sharded_state_dict()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model_sd,
             "num_floating_point_operations_so_far": 1234.0,
             "opt_param_scheduler": scheduler_state(iteration),
             "rng_state": ShardedObject(
                 "rng_state", [rng_state()],
                 (1, ps.get_tensor_model_parallel_world_size()),
                 (0, ps.get_tensor_model_parallel_rank()),
                 replica_id=ps.get_data_parallel_rank())}
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state(optimizer, model_sd)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, folder)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def load_ours(iter_dir: str) -> torch.Tensor:
    """Our torch_dist checkpoint read by megatron-core into its GPTModel at tp 2."""
    common = torch.load(os.path.join(iter_dir, "common.pt"), weights_only=False)
    args = common["args"]
    args.tensor_model_parallel_size = 2
    model = build_model(args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
    model.load_state_dict(state["model"])
    return logits(model)


def _run(rank: int, world: int, port: int, out: str, ours: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _stand_in_for_cuda()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # megatron-core's inference generator tracker: attention dropout (p = 0 here) forks no
    # CUDA generator.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    result = {"tokens": TOKENS}
    for tp, tied, fused, with_optimizer in ((1, True, True, True), (2, False, False, False)):
        ps.initialize_model_parallel(tp, 1)
        torch.manual_seed(100 + tp)
        args = megatron_args(tp, tied, fused, iteration=10 * tp)
        model = build_model(args)
        optimizer = adam_step(model) if with_optimizer else None
        save_like_megatron_lm(os.path.join(out, f"mcore_tp{tp}"), model, args, optimizer)
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


def main() -> None:
    out, ours = sys.argv[1], sys.argv[2:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_run, args=(2, port, out, ours), nprocs=2)


if __name__ == "__main__":
    main()
