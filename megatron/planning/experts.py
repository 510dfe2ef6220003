"""What mixture-of-experts layers (megatron/model/moe.py) add to a plan: parameters in total
and active per token, the rows each rank's experts compute, the bytes the expert-parallel
dispatch moves, and the activations an MoE layer keeps for the backward pass.

Symbols: E experts of width f_e (--moe-ffn-hidden-size), top-k routing, h hidden, t tensor-
parallel size, n the expert-parallel size, e the bytes of the params dtype, m = 2 matrices
into the FFN with SwiGLU (else 1), T = s b the tokens a tensor rank routes per micro-batch
(the whole sequence: under sequence parallelism the layer gathers it first)::

    one expert          m f_e h + f_e h  (+ m f_e + h biases with --add-bias-linear)
    one MoE layer       router E h + E experts + the shared expert (an MLP of width
                        --moe-shared-expert-intermediate-size, its gate h more)
    active parameters   the total less (E - k) experts per MoE layer: what one token meets

Routing is data; the plan assumes it balanced, as the rehearsal makes it
(megatron/planning/rehearsal/routing.py): token i's k slots i k ... i k + k - 1 go to experts
(slot mod E), so expert j gets c_j = ceil((T k - j) / E) tokens (T k / E when E divides T k),
kept up to the capacity ceil(T k / E x factor) under --moe-expert-capacity-factor (exactly the
capacity with --moe-pad-expert-input-to-capacity). P = sum_j c_j pairs leave a rank; its E/n
local experts compute R = n x (their c_j) rows (every rank of the group routes alike; R = P
without expert parallelism).

Dispatch payload per rank per MoE layer per micro-batch, forward and backward (the rehearsal's
convention, megatron/planning/rehearsal/records.py: an all-to-all's input, an all-gather's
gathered output, a reduce-scatter's input; about (n - 1)/n of it leaves the rank)::

    alltoall    2 (P + R) h e  +  8 E     tokens out and back, each again backward; the counts
    allgather   4 n T h e  +  9 n T E     tokens gathered and the outputs reduce-scattered, each
                                          again backward; the fp32 routing weights gathered
                                          (and their gradients reduce-scattered), the 1-byte map
                                          gathered

Activations one MoE layer keeps per micro-batch, in place of the dense MLP's FC1 input and
its 2 f/t (megatron/planning/planner.py's per-layer formula, whose attention part stays)::

    router      T h x 4 bytes (its fp32 input) + 3 T E x 4 (logits, scores, weights)
    experts     R (h + 2 f_e/t) e (the dense MLP's terms, per routed row) + P h e (the
                weighted outputs)
    shared      T (h + 2 f_s/t) e, + T h e for its gate's product; its input is the router's
                (not counted again) in an fp32 model
"""

from __future__ import annotations

import math

from megatron.config import ModelConfig, RunConfig

FP32 = 4


def mlp_parameters(m: ModelConfig, width: int) -> int:
    into = 2 if m.swiglu else 1
    bias = (into * width + m.hidden_size) if m.add_bias_linear else 0
    return (into + 1) * width * m.hidden_size + bias


def expert_parameters(m: ModelConfig) -> int:
    """Parameters of one routed expert (the whole expert, all tensor ranks)."""
    return mlp_parameters(m, m.moe_ffn_hidden_size)


def moe_mlp_parameters(m: ModelConfig) -> int:
    """One MoE layer's parameters in place of the dense MLP: router, experts, shared expert
    (and its gate)."""
    shared = m.moe_shared_expert_intermediate_size
    total = m.num_experts * m.hidden_size + m.num_experts * expert_parameters(m)
    if shared is not None:
        total += mlp_parameters(m, shared) + (m.hidden_size if m.moe_shared_expert_gate else 0)
    return total


def num_moe_layers(m: ModelConfig) -> int:
    return sum(m.moe_layers)


def inactive_parameters(m: ModelConfig) -> int:
    """Parameters a token does not meet: the E - k experts it is not routed to, per MoE
    layer."""
    if m.num_experts is None:
        return 0
    return num_moe_layers(m) * (m.num_experts - m.moe_router_topk) * expert_parameters(m)


def routed_tokens(config: RunConfig) -> int:
    """T: tokens one tensor rank routes per micro-batch (the whole sequence)."""
    return config.model.seq_length * config.training.micro_batch_size


def expert_rows(config: RunConfig) -> list[int]:
    """Rows each expert computes for one rank's T tokens under balanced routing (module
    docstring), capacity applied."""
    m = config.model
    tokens, experts, k = routed_tokens(config), m.num_experts, m.moe_router_topk
    counts = [(tokens * k - j + experts - 1) // experts for j in range(experts)]
    factor = m.moe_expert_capacity_factor
    if factor is None:
        return counts
    capacity = math.ceil(tokens * k / experts * factor)
    if capacity >= tokens:  # every token fits (moe.drop_tokens keeps all; padding: all T)
        return [tokens] * experts if m.moe_pad_expert_input_to_capacity else counts
    if m.moe_pad_expert_input_to_capacity:
        return [capacity] * experts
    return [min(c, capacity) for c in counts]


def sent_and_computed_rows(config: RunConfig) -> tuple[int, int]:
    """(P, R): the (token, expert) pairs one rank routes, and the rows the local experts of
    expert-parallel rank 0 compute."""
    m, n = config.model, config.parallel.expert_model_parallel_size
    rows = expert_rows(config)
    local = m.num_experts // n
    return sum(rows), n * sum(rows[:local])


def dispatch_bytes_per_layer(config: RunConfig) -> tuple[int, int]:
    """Payload one rank hands the expert group's collectives per MoE layer and micro-batch,
    (forward, backward) (module docstring); nothing without expert parallelism."""
    m, n = config.model, config.parallel.expert_model_parallel_size
    if m.num_experts is None or n == 1:
        return 0, 0
    h, e = m.hidden_size, _bytes(m)
    if m.moe_token_dispatcher_type == "alltoall":
        sent, computed = sent_and_computed_rows(config)
        return (sent + computed) * h * e + 8 * m.num_experts, (sent + computed) * h * e
    tokens = routed_tokens(config)
    # Forward: tokens, fp32 weights and the 1-byte map gathered, outputs reduce-scattered;
    # backward: the tokens' and weights' gradients reduce-scattered, the output's gathered.
    return (2 * n * tokens * h * e + 5 * n * tokens * m.num_experts,
            2 * n * tokens * h * e + 4 * n * tokens * m.num_experts)


def moe_layer_activation_bytes(config: RunConfig) -> int:
    """What one MoE layer keeps for backward per micro-batch beyond the attention part of the
    dense formula (module docstring)."""
    m, t = config.model, config.parallel.tensor_model_parallel_size
    tokens, h, e = routed_tokens(config), m.hidden_size, _bytes(m)
    sent, computed = sent_and_computed_rows(config)
    router = tokens * h * FP32 + 3 * tokens * m.num_experts * FP32
    experts = (computed * (h + 2 * m.moe_ffn_hidden_size // t) + sent * h) * e
    shared = 0
    width = m.moe_shared_expert_intermediate_size
    if width is not None:
        own_input = 0 if e == FP32 else tokens * h * e
        shared = own_input + tokens * 2 * width // t * e
        shared += tokens * h * e if m.moe_shared_expert_gate else 0
    return router + experts + shared


def _bytes(m: ModelConfig) -> int:
    return m.params_dtype.itemsize
