"""What a layout costs before it is launched: parameters, memory per GPU, bubble and FLOPs.

Every (tensor rank, pipeline stage) of the layout is built as that rank would build it, on
PyTorch's meta device (shapes, no memory), so the parameter counts are the model's own, not
a formula's; the closed form they equal is printed beside them. Memory per GPU is counted in
bytes from those counts and the formulas below (printed by ``format_plan``)::

    weights     P x bytes(param dtype)                          (/ dp under ZeRO-3)
    gradients   P x bytes(grad dtype: fp32 with --bf16, for fp32 models, or with
                --accumulate-allreduce-grads-in-fp32; else the param dtype)  (/ dp ZeRO >= 2)
    optimizer   P x (4 for the fp32 main copy under fp16/bf16 + 8 for Adam's two moments,
                4 for SGD's momentum)          (/ dp with --use-distributed-optimizer or ZeRO >= 1)
                experts under --expert-model-parallel-size n: their sharded state over the
                dp / n ranks that hold the same experts
    activations per micro-batch in flight, per layer, in elements (t: tensor parallel size,
                t_sp: t under --sequence-parallel else 1, f: FFN width, a: kv_channels x heads)
                    s b (2h/t_sp + 2h/t_sp + (3a + a + a)/t + 2f/t)
                    LN inputs, QKV/FC1 inputs (this rank's part of the sequence: the
                    backward all-gathers it again), QKV out, attention out and its copy,
                    FC1 out, GeLU out; attention in a fused kernel (no s^2 term)
                + 2 s b h / t_sp bytes of dropout masks when --hidden-dropout > 0
                mixture-of-experts layers: the router's and experts' terms in place of the
                  FC1 input and 2f/t (megatron/planning/experts.py)
                selective recompute: less the attention output (s b a / t)
                full recompute: s b h / t_sp per checkpointed block, plus one block's layers
                  live while it is recomputed
                first stage: embedding output s b h / t_sp; last stage: final LN input
                  s b h / t_sp, its gathered copy s b h, and the fp32 logits s b V / t
                micro-batches in flight on stage i: min(m, p - i) (1F1B); interleaved:
                  min(m v, 2 (p - i - 1) + (v - 1) p + 1) chunks of L / (p v) layers,
                  the first/last stage's extras on 1 in v of them
    step        the fp32 copies of fp16/bf16 gradients made for the optimizer step
                (P x 4 bytes when the gradient buffer is not fp32), live after the
                activations are freed, so the peak is weights + grads + optimizer
                + max(activations, step)

Pipeline bubble: ``(p - 1) / (v m)`` of the ideal compute time (Megatron's 1F1B figure).
FLOPs per iteration: ``megatron.planning.flops.flops_per_token`` x tokens of the global batch.

Against the published formulas (``tools/plan.py --compare-formulas``, megatron/planning/memory_formulas.py:
Korthikanti et al. 2022 and Megatron-LM's theoretical_memory_usage.py). For the GPT-3 175B
recipe (tensor 8 x pipeline 8, micro-batch 1, sequence 2048, fp16, distributed optimizer over
one replica), first stage, GB = 2^30 bytes, ours / formula:

    layout                      weights+grads+optimizer   activations
    SP, recompute none          42.06 / 46.88 (-10.3%)    10.17 / 32.09 (-68.3%)
    SP, recompute selective     42.06 / 46.88 (-10.3%)     9.61 /  9.59  (+0.2%)
    SP, recompute full          42.06 / 46.88 (-10.3%)     0.71 /  0.59 (+22.0%)
    no SP, recompute none       42.06 / 46.88 (-10.3%)    30.19 / 54.53 (-44.6%)
    no SP, recompute selective  42.06 / 46.88 (-10.3%)    29.62 / 30.91  (-4.2%)
    no SP, recompute full       42.06 / 46.88 (-10.3%)     5.19 /  4.92  (+5.4%)

Every difference above 5%, and why (each is what our code holds, not a miscount; the test
tests/unit/test_memory_formulas.py keeps this list and the figures in step):

- weights + gradients + optimizer, -10.3% everywhere: the formula's 18 bytes per parameter
  assume fp32 gradients; an fp16 run without --accumulate-allreduce-grads-in-fp32 keeps its
  gradient buffers in fp16 (16 bytes per parameter, -11.1%; with the flag the figures agree to
  1%). We also count what the formula leaves out: learned position embeddings on the first
  stage and the linear layers' biases (+0.9%).
- activations without recomputation, -68% (SP) and -45% (no SP): the formula keeps attention's
  scores, softmax and dropout mask (5 a s^2 b / t bytes per layer, 80 sbh/t at s = 2048); we
  count a fused attention kernel (the recipe's --use-flash-attn, or PyTorch's SDPA flash
  kernel on a GPU), which keeps none of the s x s tensors.
- activations under full recompute, +22% (SP) and +5.4% (no SP): we add the working set the
  backward rebuilds, one layer's full activations while it is recomputed (0.19 GB here), and
  the first stage's embedding output per micro-batch in flight; the formula keeps only each
  layer's input.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from megatron.assembly.build import build_gpt_chunk, gradients_in_fp32
from megatron.config import RunConfig
from megatron.core.distributed.distributed_data_parallel import is_expert
from megatron.core.tensor_parallel.layers import assume_tensor_parallel_rank
from megatron.model.gpt_model import GPTModel
from megatron.model.placement import stage_chunks
from megatron.planning import experts
from megatron.planning.flops import flops_per_token

GB = 2**30


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes on one GPU, by kind."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    step: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + max(self.activations, self.step)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    pipeline_rank: int
    layers: int
    params_per_rank: tuple[int, ...]  # by tensor-parallel rank
    memory: Memory  # of the tensor rank with the most parameters
    microbatches_in_flight: int
    # Of params_per_rank, the experts' under expert parallelism (reduced and sharded over
    # the expert-data-parallel ranks); 0 without.
    experts_per_rank: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    config: RunConfig
    zero_stage: int
    stages: tuple[StagePlan, ...]
    total_params: int  # unique: replicated and tied copies counted once
    active_params: int  # what one token meets: total less the experts it is not routed to
    closed_form_params: int
    closed_form: str
    bubble_fraction: float
    flops_per_iteration: float
    gpu_memory_gb: Optional[float]

    @property
    def peak_memory(self) -> int:
        return max(stage.memory.total for stage in self.stages)

    @property
    def fits(self) -> Optional[bool]:
        if self.gpu_memory_gb is None:
            return None
        return self.peak_memory <= self.gpu_memory_gb * GB


# ----------------------------------------------------------------------------- parameters


def build_rank_on_meta(config: RunConfig, tp_rank: int, pp_rank: int) -> list[GPTModel]:
    """The model chunks rank (``tp_rank``, ``pp_rank``) builds, on the meta device."""
    model_config = config.model.replace(perform_initialization=False)
    with assume_tensor_parallel_rank(config.parallel.tensor_model_parallel_size, tp_rank):
        return [build_gpt_chunk(model_config, chunk, torch.device("meta"))
                for chunk in stage_chunks(config, pp_rank)]


def _unique_count(chunks: list[GPTModel], tp_rank: int, pipeline_parallel: bool,
                  expert_parallel: int) -> int:
    """Parameters of this rank and of the other ranks of its expert group (which hold the
    other experts, shaped alike) that belong to no other rank of its pipeline stage: its
    tensor-parallel shards, and the replicated ones on tensor rank 0 only. The last stage's
    copy of the tied word embeddings is the first stage's weight again: not counted."""
    n = 0
    for chunk in chunks:
        for param in chunk.parameters():
            if pipeline_parallel and getattr(param, "shared_embedding", False):
                continue
            if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
                n += param.numel() * (expert_parallel if is_expert(param) else 1)
    return n


@dataclasses.dataclass(frozen=True)
class ParameterCount:
    """Parameters on every rank, ``[pipeline rank][tensor rank]`` (and the experts' share
    of them under expert parallelism), and the model's total."""

    per_rank: list[tuple[int, ...]]
    experts_per_rank: list[tuple[int, ...]]
    total: int


def _count_stage(config: RunConfig, pp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(parameters, experts among them) of each tensor rank of stage ``pp_rank``, and the
    stage's unique parameters (``_unique_count``)."""
    p = config.parallel
    row, expert_row, unique = [], [], 0
    for tp_rank in range(p.tensor_model_parallel_size):
        chunks = build_rank_on_meta(config, tp_rank, pp_rank)
        params = [param for c in chunks for param in c.parameters()]
        row.append(sum(param.numel() for param in params))
        expert_row.append(sum(param.numel() for param in params if is_expert(param)))
        unique += _unique_count(chunks, tp_rank, p.pipeline_model_parallel_size > 1,
                                p.expert_model_parallel_size)
    return tuple(row), tuple(expert_row), unique


def count_parameters(config: RunConfig) -> ParameterCount:
    """Every rank built on the meta device, counted (one rank of each expert group stands
    for the others: they hold as many experts)."""
    stages = [_count_stage(config, pp_rank)
              for pp_rank in range(config.parallel.pipeline_model_parallel_size)]
    return ParameterCount([row for row, _, _ in stages], [row for _, row, _ in stages],
                          sum(unique for _, _, unique in stages))


def closed_form_parameters(config: RunConfig) -> tuple[int, str]:
    """The parameter count in closed form, and the formula with this model's symbols.

    Per layer: two norms (2h each as LayerNorm, h as RMSNorm), QKV ((a + 2k) h + a + 2k, k
    the key/value width: kv_channels x query groups, k = a without grouped-query attention),
    attention output (ah + h), FC1 (fh + f; twice that with SwiGLU), FC2 (fh + h), biases
    only with --add-bias-linear (the QKV's also with --add-qkv-bias); then the word
    embeddings (V h, V padded), learned positions (P h), the final norm (2h or h) and,
    untied, the output layer (V h). GPT with a = h and f = 4h: 12 L h^2 + 13 L h + V h +
    P h + 2 h. Mixture-of-experts layers hold a router and experts instead of the MLP
    (``_with_experts``)."""
    total, text = _dense_closed_form(config)
    return _with_experts(config.model, total, text)


def _dense_closed_form(config: RunConfig) -> tuple[int, str]:
    m = config.model
    h, f, a, L, V = m.hidden_size, m.ffn_hidden_size, m.projection_size, m.num_layers, \
        m.padded_vocab_size
    k, fc1 = m.kv_projection_size, (2 if m.swiglu else 1) * m.ffn_hidden_size
    norm = h if m.normalization == "RMSNorm" else 2 * h
    bias = 1 if m.add_bias_linear else 0
    qkv_bias = a + 2 * k if m.add_bias_linear or m.add_qkv_bias else 0
    per_layer = (2 * norm + (a + 2 * k) * h + a * h + fc1 * h + f * h + qkv_bias
                 + bias * (h + fc1 + h))
    pos = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else 0
    heads = 2 if m.untie_embeddings_and_output_weights else 1
    total = L * per_layer + heads * V * h + pos * h + norm
    if not _gpt_shaped(m):
        return total, _family_text(m, pos, heads)
    if a == h and f == 4 * h and bias and heads == 1:
        text = "12 L h^2 + 13 L h + V h + P h + 2 h" if pos else "12 L h^2 + 13 L h + V h + 2 h"
    else:
        text = ("L (4h + 4ah + 2fh" + (" + 3a + 2h + f" if bias else "") + ") + "
                + ("2 " if heads == 2 else "") + "V h" + (" + P h" if pos else "") + " + 2 h")
    symbols = f"L={L}, h={h}, V={V} (padded)" + (f", P={pos}" if pos else "") + \
        ("" if a == h and f == 4 * h else f", a={a}, f={f}")
    return total, f"{text} with {symbols}"


def _with_experts(m, total: int, text: str) -> tuple[int, str]:
    """The closed form with each MoE layer's dense MLP swapped for its router, E experts and
    shared expert (megatron/planning/experts.py)."""
    if m.num_experts is None:
        return total, text
    moe_layers, into = experts.num_moe_layers(m), 2 if m.swiglu else 1
    bias = 1 if m.add_bias_linear else 0
    dense = experts.mlp_parameters(m, m.ffn_hidden_size)
    total += moe_layers * (experts.moe_mlp_parameters(m) - dense)
    expert = f"{into + 1} f_e h" + (f" + {into} f_e + h" if bias else "")
    shared = m.moe_shared_expert_intermediate_size
    text += (f"; in L_e layers the MLP gives way to E h + E ({expert})"
             + (f" + a shared expert ({into + 1} f_s h" + (" + h gate" if m.moe_shared_expert_gate
                                                           else "") + ")" if shared else "")
             + f" with L_e={moe_layers}, E={m.num_experts}, f_e={m.moe_ffn_hidden_size}"
             + (f", f_s={shared}" if shared else ""))
    return total, text


# ----------------------------------------------------------------------------- memory


def _gpt_shaped(m) -> bool:
    return not (m.swiglu or m.group_query_attention or m.normalization == "RMSNorm"
                or m.add_qkv_bias)


def _family_text(m, pos: int, heads: int) -> str:
    """The closed form's text for Llama-family options (SwiGLU, GQA, RMSNorm)."""
    n = "h" if m.normalization == "RMSNorm" else "2h"  # one norm's parameters
    norms = "2h" if m.normalization == "RMSNorm" else "4h"
    fc1 = "2fh" if m.swiglu else "fh"
    biases = " + a + 2k" if m.add_bias_linear or m.add_qkv_bias else ""
    if m.add_bias_linear:
        biases += " + 2h + " + ("2f" if m.swiglu else "f")
    text = (f"L ({norms} + (a + 2k) h + ah + {fc1} + fh{biases}) + "
            + ("2 " if heads == 2 else "") + "V h" + (" + P h" if pos else "") + f" + {n}")
    symbols = (f"L={m.num_layers}, h={m.hidden_size}, V={m.padded_vocab_size} (padded), "
               f"a={m.projection_size}, k={m.kv_projection_size}, f={m.ffn_hidden_size}"
               + (f", P={pos}" if pos else ""))
    return f"{text} with {symbols}"


def bytes_of(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def grad_bytes(config: RunConfig) -> int:
    """Bytes per element of the data-parallel gradient buffers."""
    return 4 if gradients_in_fp32(config.optimizer) else bytes_of(config.model.params_dtype)


def _state_memory(config: RunConfig, params: int, zero_stage: int,
                  expert_params: int = 0) -> tuple[int, int, int, int]:
    """(weights, gradients, optimizer, step) bytes for ``params`` parameters on one rank,
    ``expert_params`` of them experts of expert parallelism (their state is sharded over the
    expert-data-parallel ranks, the data-parallel ranks holding the same experts)."""
    p = config.parallel
    # Sharded state spreads over the context-parallel ranks too (they hold the same weights).
    dp = config.data_parallel_size * p.context_degree
    dense = _sharded_state(config, params - expert_params, zero_stage, dp)
    expert = _sharded_state(config, expert_params, zero_stage,
                            dp // p.expert_model_parallel_size)
    return tuple(a + b for a, b in zip(dense, expert))


def _sharded_state(config: RunConfig, params: int, zero_stage: int,
                   dp: int) -> tuple[int, int, int, int]:
    m, o = config.model, config.optimizer
    param_bytes = bytes_of(m.params_dtype)
    mixed = m.fp16 or m.bf16
    grad_fp32 = gradients_in_fp32(o)
    if o.optimizer == "adam":
        state_bytes = 8
    else:
        state_bytes = 4 if o.sgd_momentum > 0 else 0
    state_bytes += 4 if mixed else 0
    shard_optimizer = zero_stage >= 1 or o.use_distributed_optimizer
    weights = params * param_bytes // (dp if zero_stage >= 3 else 1)
    gradients = params * grad_bytes(config) // (dp if zero_stage >= 2 else 1)
    optimizer = params * state_bytes // (dp if shard_optimizer else 1)
    step = 0 if grad_fp32 else params * 4 // (dp if shard_optimizer else 1)
    return weights, gradients, optimizer, step


def layer_activationbytes_of(config: RunConfig, moe: bool = False) -> int:
    """One transformer layer's saved activations for one micro-batch (module docstring); a
    mixture-of-experts layer (``moe``) keeps its router's and experts' instead of the MLP's
    FC1 input and 2 f/t (megatron/planning/experts.py)."""
    m, t = config.model, config.parallel.tensor_model_parallel_size
    t_sp = t if config.parallel.sequence_parallel else 1
    s, b, h, f, a = m.local_seq_length, config.training.micro_batch_size, m.hidden_size, \
        m.ffn_hidden_size, m.projection_size
    attention_out = s * b * a // t
    elements = s * b * 4 * h // t_sp + s * b * (5 * a + 2 * f) // t
    if m.recompute_granularity == "selective":
        elements -= attention_out
    if moe:
        elements -= s * b * h // t_sp + s * b * 2 * f // t
    masks = 2 * s * b * h // t_sp if m.hidden_dropout > 0 else 0
    moe_bytes = experts.moe_layer_activation_bytes(config) if moe else 0
    return elements * bytes_of(m.params_dtype) + masks + moe_bytes


def _in_flight(config: RunConfig, pp_rank: int) -> tuple[int, int]:
    """(model chunks in flight at the peak, layers per chunk) on stage ``pp_rank``."""
    p = config.parallel.pipeline_model_parallel_size
    v = config.parallel.virtual_pipeline_model_parallel_size or 1
    m = config.num_microbatches
    stage_layers = config.pipeline_stage_num_layers[pp_rank]
    if v == 1:
        return min(m, p - pp_rank), stage_layers
    return min(m * v, 2 * (p - pp_rank - 1) + (v - 1) * p + 1), stage_layers // v


def stage_moe_flags(config: RunConfig, pp_rank: int) -> list[tuple[bool, ...]]:
    """For each model chunk of stage ``pp_rank``, which of its layers are mixtures of
    experts."""
    flags = config.model.moe_layers
    return [flags[c.first_layer:c.first_layer + c.num_layers]
            for c in stage_chunks(config, pp_rank)]


def _chunk_activations(config: RunConfig, moe: tuple[bool, ...]) -> int:
    """Saved activations of a chunk's layers (``moe``: which are mixtures of experts) for one
    micro-batch, under the recompute setting (full recomputation keeps block inputs; one
    block is live while recomputed)."""
    m, layers = config.model, len(moe)
    per_layer = {kind: layer_activationbytes_of(config, kind) for kind in set(moe)}
    t_sp = config.parallel.tensor_model_parallel_size if config.parallel.sequence_parallel \
        else 1
    block_input = m.local_seq_length * config.training.micro_batch_size * m.hidden_size // t_sp \
        * bytes_of(m.params_dtype)
    if m.recompute_granularity != "full":
        return sum(per_layer[kind] for kind in moe)
    k = min(m.recompute_num_layers or 1, layers)
    if m.recompute_method == "uniform":
        return math.ceil(layers / k) * block_input
    return k * block_input + sum(per_layer[kind] for kind in moe[k:])


def _working_set(config: RunConfig, moe: tuple[bool, ...]) -> int:
    """What full recomputation rebuilds at once during the backward pass (one block; its
    layers counted as the chunk's largest)."""
    m = config.model
    if m.recompute_granularity != "full" or not moe:
        return 0
    k = min(m.recompute_num_layers or 1, len(moe))
    largest = max(layer_activationbytes_of(config, kind) for kind in set(moe))
    return (k if m.recompute_method == "uniform" else 1) * largest


def activation_memory(config: RunConfig, pp_rank: int) -> tuple[int, int]:
    """(bytes of activations at the peak, micro-batches in flight) on stage ``pp_rank``."""
    m, p = config.model, config.parallel
    t = p.tensor_model_parallel_size
    t_sp = t if p.sequence_parallel else 1
    chunks, _ = _in_flight(config, pp_rank)
    tokens = m.local_seq_length * config.training.micro_batch_size  # this rank's share
    e = bytes_of(m.params_dtype)
    extras = 0
    if pp_rank == 0:
        extras += tokens * m.hidden_size // t_sp * e
    if pp_rank == p.pipeline_model_parallel_size - 1:
        # final LN input, its gathered copy, and the logits (fp32, the softmax's dtype)
        extras += tokens * m.hidden_size // t_sp * e + tokens * m.hidden_size * e \
            + tokens * m.padded_vocab_size // t * 4
    # Interleaved: only one of the v chunks of a stage holds the embeddings or the LM head.
    v = p.virtual_pipeline_model_parallel_size or 1
    # Chunks of a stage differ only in which of their layers are mixtures of experts: the
    # largest stands for all in flight.
    flags = stage_moe_flags(config, pp_rank)
    largest = max(_chunk_activations(config, moe) for moe in flags)
    total = chunks * largest + math.ceil(chunks / v) * extras
    return total + max(_working_set(config, moe) for moe in flags), chunks


# ----------------------------------------------------------------------------- the plan


def context_bytes_per_layer(config: RunConfig) -> int:
    """Bytes one rank sends per layer and micro-batch for context-parallel attention, forward
    and backward together (megatron/core/context_parallel.py):

    - p2p: its key/value block hops N - 1 times forward; backward, the block hops N - 1 times
      and its gradients N times: ``(4(N - 1) + 2N) x s/N x b x kv/t`` elements;
    - a2a, ulysses: four all-to-alls forward (q, k, v, out) and four backward, each sending
      (N - 1)/N of ``s/N x b x width/t`` (k and v repeated to one per query head when the
      key/value heads do not divide by N);
    - allgather: keys and values gathered, ``2(N - 1) x s/N x b x kv/t`` forward, and the
      whole gradient all-reduced backward, about twice ``2 s b kv/t``.
    """
    m, p = config.model, config.parallel
    n, t = p.context_degree, p.tensor_model_parallel_size
    local = m.local_seq_length * config.training.micro_batch_size
    kv, q = m.kv_projection_size // t, m.projection_size // t
    e = bytes_of(m.params_dtype)
    kind = p.context_attention
    if n == 1:
        return 0
    if kind == "p2p":
        return (4 * (n - 1) + 2 * n) * local * kv * e
    if kind in ("a2a", "ulysses"):
        if (m.query_groups // t) % n:
            kv = q
        return 2 * (2 * q + 2 * kv) * local * (n - 1) // n * e
    return (2 * (n - 1) * local * kv + 2 * 2 * local * n * kv) * e


def bubble_fraction(config: RunConfig) -> float:
    """Pipeline bubble time over ideal compute time: (p - 1) / (v m)."""
    p = config.parallel.pipeline_model_parallel_size
    v = config.parallel.virtual_pipeline_model_parallel_size or 1
    return (p - 1) / (v * config.num_microbatches)


def flops_per_iteration(config: RunConfig) -> float:
    """Model FLOPs (forward + backward) of one iteration at the full global batch."""
    tokens = config.training.global_batch_size * config.model.seq_length
    return flops_per_token(config.model) * tokens


def _stage_plan(config: RunConfig, pp_rank: int, params_per_rank: tuple[int, ...],
                experts_per_rank: tuple[int, ...], zero_stage: int) -> StagePlan:
    fullest = max(range(len(params_per_rank)), key=params_per_rank.__getitem__)
    weights, grads, optimizer, step = _state_memory(
        config, params_per_rank[fullest], zero_stage, experts_per_rank[fullest])
    activations, in_flight = activation_memory(config, pp_rank)
    return StagePlan(pp_rank, config.pipeline_stage_num_layers[pp_rank], params_per_rank,
                     Memory(weights, grads, optimizer, activations, step), in_flight,
                     experts_per_rank)


def plan_stage(config: RunConfig, pp_rank: int, zero_stage: int = 0) -> StagePlan:
    """One pipeline stage's plan (its tensor ranks built on the meta device)."""
    row, expert_row, _ = _count_stage(config, pp_rank)
    return _stage_plan(config, pp_rank, row, expert_row, zero_stage)


def build_plan(config: RunConfig, zero_stage: int = 0,
               gpu_memory_gb: Optional[float] = None) -> Plan:
    """Count, size and time ``config``'s layout (see the module docstring)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    count = count_parameters(config)
    stages = [_stage_plan(config, pp_rank, row, expert_row, zero_stage)
              for pp_rank, (row, expert_row) in enumerate(zip(count.per_rank,
                                                              count.experts_per_rank))]
    closed, text = closed_form_parameters(config)
    active = count.total - experts.inactive_parameters(config.model)
    return Plan(config, zero_stage, tuple(stages), count.total, active, closed, text,
                bubble_fraction(config), flops_per_iteration(config), gpu_memory_gb)


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 2**20:.2f} MB"


def format_plan(plan: Plan) -> str:
    """The plan as the text ``tools/plan.py`` prints."""
    cfg, m, p = plan.config, plan.config.model, plan.config.parallel
    vp = p.virtual_pipeline_model_parallel_size or 1
    lines = [
        f"layout: tensor {p.tensor_model_parallel_size} x pipeline "
        f"{p.pipeline_model_parallel_size}"
        + (f" x context {p.context_degree} ({p.context_attention})" if p.context_degree > 1
           else "")
        + f" x data {cfg.data_parallel_size} = {p.world_size} "
        f"GPUs" + (f", {vp} virtual stages" if vp > 1 else "")
        + (", sequence parallel" if p.sequence_parallel else "")
        + (f", expert parallel {p.expert_model_parallel_size} within data "
           f"({m.moe_token_dispatcher_type})" if p.expert_model_parallel_size > 1 else ""),
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"sequence {m.seq_length}, vocabulary {m.vocab_size} padded to {m.padded_vocab_size}, "
        f"{m.params_dtype}",
        f"batch: global {cfg.training.global_batch_size}, micro {cfg.training.micro_batch_size}"
        f", {cfg.num_microbatches} micro-batches per iteration per pipeline",
        f"parameters: {plan.total_params:,} in total"
        + (f", {plan.active_params:,} active per token" if m.num_experts else "")
        + f"; closed form {plan.closed_form} = "
        f"{plan.closed_form_params:,}"
        + ("" if plan.total_params == plan.closed_form_params else "  (DIFFERS)"),
    ]
    optimizer = ("ZeRO-" + str(plan.zero_stage)) if plan.zero_stage else \
        ("distributed optimizer" if cfg.optimizer.use_distributed_optimizer else
         "optimizer state replicated")
    recompute = m.recompute_granularity or "none"
    if m.recompute_granularity == "full":
        recompute += f" ({m.recompute_method}, {m.recompute_num_layers} layer(s) per block)"
    lines.append(f"memory per GPU, GB = 2^30 bytes ({optimizer}; recompute: {recompute}):")
    for st in plan.stages:
        mem = st.memory
        lines.append(
            f"  stage {st.pipeline_rank}: {st.layers} layers, params per tensor rank "
            f"{st.params_per_rank[0]:,}" + ("" if len(set(st.params_per_rank)) == 1
                                            else f" (max {max(st.params_per_rank):,})")
            + (f" ({st.experts_per_rank[0]:,} of them experts)" if any(st.experts_per_rank)
               else "")
            + f" | weights {_gb(mem.weights)} | gradients {_gb(mem.gradients)} | optimizer "
            f"{_gb(mem.optimizer)} | activations {_gb(mem.activations)} "
            f"({st.microbatches_in_flight} in flight) | step {_gb(mem.step)} "
            f"| total {_gb(mem.total)}")
    lines.append(f"peak memory per GPU: {_gb(plan.peak_memory)}"
                 + ("" if plan.fits is None else
                    f" of {plan.gpu_memory_gb:g} GB: {'fits' if plan.fits else 'DOES NOT FIT'}"))
    lines.append(f"pipeline bubble: (p - 1) / (v m) = {plan.bubble_fraction:.4f}")
    if p.context_degree > 1:
        lines.append(f"context parallel: {m.local_seq_length} of {m.seq_length} tokens per "
                     f"rank; {_gb(context_bytes_per_layer(cfg))} sent per rank per layer per "
                     f"micro-batch (forward and backward, {p.context_attention})")
    if m.num_experts is not None:
        lines.append(_experts_line(cfg))
    lines.append(f"FLOPs per iteration: {plan.flops_per_iteration:.4e} "
                 f"({plan.flops_per_iteration / p.world_size:.4e} per GPU)"
                 + ("; MoE layers count the router and the k experts each token meets"
                    if m.num_experts is not None else ""))
    lines.append("formulas:" + __doc__.split("::", 1)[1].split("Pipeline bubble")[0].rstrip())
    return "\n".join(lines)


def _experts_line(cfg: RunConfig) -> str:
    """Experts per layer and rank, and the dispatch's bytes (megatron/planning/experts.py)."""
    m, n = cfg.model, cfg.parallel.expert_model_parallel_size
    line = (f"experts: {m.num_experts} in each of {experts.num_moe_layers(m)} MoE layers, top-"
            f"{m.moe_router_topk}, {m.num_experts // n} per rank")
    if n == 1:
        return line + " (no expert parallelism: no dispatch traffic)"
    return (line + f" (expert parallel {n}); {_gb(sum(experts.dispatch_bytes_per_layer(cfg)))} "
            f"handed to the {m.moe_token_dispatcher_type} per rank per MoE layer per micro-"
            f"batch (forward and backward, balanced routing; (n - 1)/n of it leaves the rank)")
