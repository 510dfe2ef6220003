"""Mixture-of-experts layers (Megatron-LM's MoE).

A router scores each token against ``E`` experts, sends it to its top ``k``, and the layer's
output is the routed experts' outputs weighted by the routing probabilities (plus a shared
expert's, if any). The definitions follow megatron-core's ``transformer/moe/router.py`` and
``moe_utils.py``:

- routing (``route``): softmax over the top-k logits (``--moe-router-pre-softmax``: softmax
  over all experts, then the top k), or sigmoid scores of the top k renormalised to sum to 1;
- the load-balancing loss (``load_balancing_loss``, the Switch Transformer's):
  ``coeff * E * sum_i f_i P_i``, ``f_i`` the share of the ``T * k`` routing slots given to
  expert ``i`` and ``P_i`` the mean over tokens of its probability under the full softmax;
- the z-loss (``z_loss``): ``coeff * mean_t logsumexp(logits_t)^2``;
- capacity (``drop_tokens``): each expert keeps at most ``ceil(T * k / E * factor)`` tokens;
- the shared expert's gate (``--moe-shared-expert-gate``, Qwen2-MoE's): its output times
  ``sigmoid(x . g)`` per token (megatron-core's ``SharedExpertMLP``).

Each expert is cut over the tensor ranks like the dense MLP (``ParallelMLP``: column- then
row-parallel), and every tensor rank routes the whole sequence the same way. Under sequence
parallelism the layer gathers the sequence first and hands back each rank's part. With
expert parallelism (``--expert-model-parallel-size N``) a rank holds ``E / N`` experts (rank
``r`` of the expert group: experts ``r E/N ...``, ``local_experts.j`` being expert
``r E/N + j``), routes its own tokens, and the tokens reach their experts' ranks and come
back either by all-to-all (only the chosen (token, expert) pairs travel) or by all-gather
(every rank computes its experts' share of all the group's tokens; the shares are summed back
by reduce-scatter). An expert sees the same rows it would in one process, so every layout
computes what one process does, up to the order of floating-point sums.

The router losses join training the way Megatron-LM adds them: an autograd function that is
the identity on the routing probabilities and, in the backward pass, adds the loss's gradient
scaled as the language-model loss is (``set_loss_scale``: 1 / micro-batches, times the fp16
loss scale). Their values (divided by their coefficients, as Megatron-LM reports them) stay on
each layer; the training engine adds them up over a step's micro-batches
(``record_reported``), and averages them over the layers of every pipeline stage and over the
data-parallel ranks for the log line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core import expert_parallel, parallel_state
from megatron.core.grad_accumulation import refuse_fusion
from megatron.core.tensor_parallel import mappings
from megatron.model.init import InitRNG

LOAD_BALANCING = "load_balancing_loss"  # Megatron-LM's names in the log and TensorBoard
SEQ_LOAD_BALANCING = "seq_load_balancing_loss"
Z_LOSS = "z_loss"


# ----------------------------------------------------------------------------- routing maths


def route(logits: torch.Tensor, topk: int, score_function: str = "softmax",
          pre_softmax: bool = False, expert_bias: Optional[torch.Tensor] = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)``, both ``[T, E]``: each token's weight for each expert (0 where
    not routed) and whether it is routed there (``k`` per token). ``logits`` ``[T, E]``.
    ``expert_bias`` ``[E]`` (sigmoid only): added to the scores to choose the experts, not to
    the weights."""
    if score_function == "softmax":
        if pre_softmax:
            scores, top = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(topk, dim=1)
        else:
            top_logits, top = logits.topk(topk, dim=1)
            scores = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid" and expert_bias is not None:
        sigmoid = torch.sigmoid(logits.float())
        top = (sigmoid + expert_bias).topk(topk, dim=1).indices
        scores = sigmoid.gather(1, top)
        if topk > 1:
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    elif score_function == "sigmoid":
        scores, top = torch.sigmoid(logits.float()).topk(topk, dim=1)
        if topk > 1:
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    probs = torch.zeros_like(logits, dtype=scores.dtype).scatter(1, top, scores)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return probs, routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Tokens one expert takes: ``ceil(T * k / E * factor)`` (megatron-core's
    ``get_capacity``)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_tokens(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float,
                policy: str = "probs", pad_to_capacity: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` with each expert's tokens beyond its capacity dropped: it keeps
    those of highest probability (``probs``) or the first in token order (``position``).
    ``pad_to_capacity``: each expert's map holds exactly its capacity of tokens (the extra
    ones with weight 0)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    elif policy == "probs":
        chosen = probs.topk(capacity, dim=0, sorted=False).indices  # [capacity, E]
        keep = torch.zeros_like(routing_map).scatter(0, chosen, True)
    elif policy == "position":
        # The first ``capacity`` routed tokens of each expert, then (for padding) the first
        # unrouted ones: megatron-core's top-k over the 0/1 map, with its ties in token order.
        order = routing_map.long() * (num_tokens + 1) - torch.arange(
            num_tokens, device=probs.device).unsqueeze(1)  # routed first, then earliest
        chosen = order.topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, chosen, True)
    else:
        raise ValueError(f"unknown token drop policy {policy!r}")
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def load_balancing_loss(logits: torch.Tensor, topk: int, coeff: float,
                        score_function: str = "softmax") -> torch.Tensor:
    """The Switch Transformer's auxiliary loss over the tokens of ``logits`` ``[T, E]``:
    ``coeff * E * sum_i f_i P_i`` with ``f_i`` = routing slots to expert ``i`` / ``(T k)``
    and ``P_i`` = mean over tokens of its full-softmax (or normalised sigmoid) score. Equal
    to ``coeff`` when routing and scores are uniform. Routing is the top-k of those scores,
    before any token is dropped (megatron-core's)."""
    num_tokens, num_experts = logits.shape
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = scores.topk(topk, dim=1).indices
    tokens_per_expert = torch.zeros_like(scores).scatter(1, top, 1.0).sum(dim=0)  # [E]
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (
        num_experts * coeff / (topk * num_tokens * num_tokens))


def sequence_load_balancing_loss(logits: torch.Tensor, seq_length: int, topk: int,
                                 coeff: float, score_function: str = "softmax") -> torch.Tensor:
    """``load_balancing_loss`` of each sequence on its own, averaged over the sequences;
    ``logits`` ``[s * b, E]`` sequence-major (Megatron's ``[s, b]`` token order)."""
    num_experts = logits.size(1)
    per_sequence = logits.view(seq_length, -1, num_experts).transpose(0, 1)  # [b, s, E]
    return torch.stack([load_balancing_loss(seq, topk, coeff, score_function)
                        for seq in per_sequence]).mean()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff * mean_t logsumexp(logits_t)^2``."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """Row block ``i`` of ``x`` (rows ``offs[i-1]:offs[i]``) times ``weights[i]``: torch's
    grouped product (``F.grouped_mm``; before torch 2.10 its private ``_grouped_mm``)."""
    return getattr(F, "grouped_mm", torch._grouped_mm)(x, weights, offs=offs)


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x``; the backward pass also gives ``loss`` the gradient ``scale`` (as if
    ``scale * loss`` had been added to the scalar being differentiated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``x``, carrying ``scale * loss`` into the backward pass."""
    return _AttachLoss.apply(x, loss, scale)


# ----------------------------------------------------------------------------- modules


class Router(nn.Module):
    """Linear ``h -> E`` without bias, computed in fp32, then routing and its losses."""

    def __init__(self, config: ModelConfig, init: InitRNG, *, device=None) -> None:
        super().__init__()
        self.config = config
        weight = torch.empty(config.num_experts, config.hidden_size)
        if init.normal() is not None:
            init.normal()(weight)
        self.weight = nn.Parameter(weight.to(device=device, dtype=config.params_dtype))
        if config.moe_router_enable_expert_bias:
            # Loss-free balancing: the bias (saved with the model) and the step's token
            # counts per expert (not saved), both fp32.
            self.register_buffer("expert_bias", torch.zeros(config.num_experts,
                                                            device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts,
                                                                  device=device),
                                 persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None
        self.loss_scale = 1.0  # set_loss_scale: the backward scale of the router losses
        self.reported: dict[str, torch.Tensor] = {}
        # record_reported: name -> (sum over the step's micro-batches, their number)
        self.step_totals: dict[str, tuple[torch.Tensor, int]] = {}
        # _count: this step's routing slots per expert [E] and dropped slots (None: none yet)
        self.step_slots: Optional[torch.Tensor] = None
        self.step_dropped: Optional[torch.Tensor] = None

    def _count(self, chosen: torch.Tensor, kept: torch.Tensor) -> None:
        """The step's routing slots per expert and the dropped ones (for the log), and, for
        loss-free balancing, the kept tokens per expert."""
        with torch.no_grad():
            per_expert = chosen.sum(dim=0).float()
            dropped = (chosen & ~kept).sum().float()
            if self.step_slots is None:
                self.step_slots, self.step_dropped = per_expert, dropped
            else:
                self.step_slots, self.step_dropped = (self.step_slots + per_expert,
                                                      self.step_dropped + dropped)
            if self.tokens_per_expert is not None:
                self.tokens_per_expert += kept.sum(dim=0).float()

    def forward(self, tokens: torch.Tensor, seq_length: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` ``[T, E]`` for ``tokens`` ``[T, h]`` (sequence-major)."""
        cfg = self.config
        logits = F.linear(tokens.float(), self.weight.float())  # [T, E]
        training = self.training and torch.is_grad_enabled()
        self.reported = {}  # this pass's only: evaluation reports none
        if cfg.moe_z_loss_coeff is not None and self.training:
            unweighted = z_loss(logits, 1.0)  # reported so, even at coefficient 0
            self.reported[Z_LOSS] = unweighted.detach()
            loss = unweighted * cfg.moe_z_loss_coeff
            if training:
                logits = attach_loss(logits, loss, self.loss_scale)
        probs, routing_map = route(logits, cfg.moe_router_topk, cfg.moe_router_score_function,
                                   cfg.moe_router_pre_softmax, self.expert_bias)
        chosen = routing_map
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(
                probs, routing_map, cfg.moe_router_topk, cfg.moe_expert_capacity_factor,
                cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity)
        if training:
            # Counted where gradients flow: once per micro-batch, also under full recompute
            # (whose first pass runs without them).
            self._count(chosen, routing_map)
        kind, coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
        if kind != "none" and coeff > 0 and self.training:
            args = (cfg.moe_router_topk, coeff, cfg.moe_router_score_function)
            loss = (load_balancing_loss(logits, *args) if kind == "aux_loss"
                    else sequence_load_balancing_loss(logits, seq_length, *args))
            name = LOAD_BALANCING if kind == "aux_loss" else SEQ_LOAD_BALANCING
            self.reported[name] = loss.detach() / coeff
            if training:
                probs = attach_loss(probs, loss, self.loss_scale)
        return probs, routing_map


class MoELayer(nn.Module):
    """Router, ``E`` experts (``local_experts``) and an optional shared expert, in place of
    a layer's MLP: ``[s, b, h] -> [s, b, h]`` (``[s/tp, b, h]`` under sequence
    parallelism).

    ``mlp``: the dense MLP class (``transformer.ParallelMLP``), built for each expert with its
    width and ``sequence_parallel=False`` (the layer has gathered the sequence already).
    """

    def __init__(self, config: ModelConfig, layer_number: int, mlp: Callable[..., nn.Module],
                 *, device=None) -> None:
        super().__init__()
        self.config = config
        self.router = Router(config, InitRNG(config, f"layer{layer_number}.router"),
                             device=device)

        def expert(key: str, width: int) -> nn.Module:
            return mlp(config, InitRNG(config, f"layer{layer_number}.{key}"), device=device,
                       ffn_hidden_size=width, sequence_parallel=False)

        self.ep_size = config.expert_model_parallel_size
        self.num_local = config.num_experts // self.ep_size
        self.first_expert = (parallel_state.get_expert_model_parallel_rank() * self.num_local
                             if self.ep_size > 1 else 0)
        # Keyed by the global expert number: the same weights at every expert-parallel size.
        self.local_experts = nn.ModuleList(
            expert(f"expert{self.first_expert + j}", config.moe_ffn_hidden_size)
            for j in range(self.num_local))
        if self.ep_size > 1:
            for param in self.local_experts.parameters():
                param.allreduce = False  # megatron-core's mark: reduced over expert-data ranks
        self.grouped = config.moe_grouped_gemm
        if self.grouped:  # the grouped product's backward hands autograd the weight grads
            for expert in self.local_experts:
                refuse_fusion(expert.dense_h_to_4h.weight)
                refuse_fusion(expert.dense_4h_to_h.weight)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = expert("shared_expert",
                                         config.moe_shared_expert_intermediate_size)
            if config.moe_shared_expert_gate:
                # On the shared expert, as megatron-core's SharedExpertMLP holds it
                # (``mlp.shared_experts.gate_weight`` [1, h], replicated, registered before
                # the expert's own linear layers).
                self.shared_experts.gate_weight = _gate_weight(
                    config, InitRNG(config, f"layer{layer_number}.shared_expert_gate"), device)
        self.sequence_parallel = (config.sequence_parallel
                                  and config.tensor_model_parallel_size > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # Every tensor rank routes the whole sequence; the gradient of the gathered input
            # is already whole on each rank (router replicated, experts all-reduced), so the
            # backward hands each rank its own part rather than summing.
            x = mappings.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False)
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)  # [T, h], sequence-major
        probs, routing_map = self.router(tokens, s)  # [T, E]
        if self.ep_size == 1:
            out = self._combine_local(tokens, probs, routing_map)
        elif self.config.moe_token_dispatcher_type == "allgather":
            out = self._by_all_gather(tokens, probs, routing_map)
        else:
            out = self._by_all_to_all(tokens, probs, routing_map)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            out = out + self._shared_expert(x)
        if self.sequence_parallel:
            out = mappings.scatter_to_sequence_parallel_region(out)
        return out

    def _run_experts(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Local expert ``j`` on ``inputs[j]`` ``[n_j, h]``. Every expert runs, even on no
        tokens, so each parameter gets its gradient (the data-parallel buckets wait for all
        of them)."""
        if self.grouped and sum(x.size(0) for x in inputs) > 0:
            return self._grouped_experts(inputs)
        return [expert(x.unsqueeze(1)).squeeze(1) for expert, x in zip(self.local_experts, inputs)]

    def _grouped_experts(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``_run_experts`` with one grouped product per projection (``--moe-grouped-gemm``):
        each expert's rows of the stacked input times its own weight. The column- and
        row-parallel steps are the experts' layers' own (tensor-parallel copy before, sum
        after, the second bias after the sum)."""
        sizes = [x.size(0) for x in inputs]
        offsets = torch.tensor(sizes, device=inputs[0].device).cumsum(0).to(torch.int32)
        first = [e.dense_h_to_4h for e in self.local_experts]
        second = [e.dense_4h_to_h for e in self.local_experts]
        x = torch.cat(inputs)  # [N, h]
        tp_group = first[0].tp_group
        if self.config.tensor_model_parallel_size > 1:
            x = mappings.copy_to_tensor_model_parallel_region(x, tp_group)
        y = grouped_mm(x, torch.stack([lin.weight.t() for lin in first]), offs=offsets)
        if first[0].bias is not None:
            y = y + self._rows_of(first, sizes)
        y = self.local_experts[0].activate(y)
        z = grouped_mm(y, torch.stack([lin.weight.t() for lin in second]), offs=offsets)
        if self.config.tensor_model_parallel_size > 1:
            z = mappings.reduce_from_tensor_model_parallel_region(z, tp_group)
        if second[0].bias is not None:
            z = z + self._rows_of(second, sizes)
        return list(z.split(sizes))

    @staticmethod
    def _rows_of(layers: list[nn.Module], sizes: list[int]) -> torch.Tensor:
        """Each layer's bias repeated for its expert's rows: ``[sum(sizes), out]``."""
        return torch.stack([lin.bias for lin in layers]).repeat_interleave(
            torch.tensor(sizes, device=layers[0].bias.device), dim=0)

    def _combine_local(self, tokens: torch.Tensor, probs: torch.Tensor,
                       routing_map: torch.Tensor) -> torch.Tensor:
        """``sum_j probs[:, j] * expert_j(tokens)`` over the local experts, for the tokens
        routed to each (``probs``/``routing_map``: the local experts' columns)."""
        rows = [routing_map[:, j].nonzero().squeeze(1) for j in range(self.num_local)]
        outputs = self._run_experts([tokens[idx] for idx in rows])
        out = torch.zeros_like(tokens)
        for j, (idx, y) in enumerate(zip(rows, outputs)):
            out = out.index_add(0, idx, y * probs[idx, j].unsqueeze(1).to(y.dtype))
        return out

    def _by_all_gather(self, tokens: torch.Tensor, probs: torch.Tensor,
                       routing_map: torch.Tensor) -> torch.Tensor:
        """Every rank of the expert group computes its experts' share of all the group's
        tokens; the reduce-scatter sums the shares and hands each rank its own tokens."""
        group = parallel_state.get_expert_model_parallel_group()
        mine = slice(self.first_expert, self.first_expert + self.num_local)
        all_tokens = expert_parallel.gather_rows(tokens, group)
        all_probs = expert_parallel.gather_rows(probs, group)[:, mine]
        all_map = expert_parallel.gather_rows(routing_map.to(torch.uint8), group)[:, mine]
        share = self._combine_local(all_tokens, all_probs, all_map.bool())
        return expert_parallel.reduce_scatter_rows(share, group)

    def _by_all_to_all(self, tokens: torch.Tensor, probs: torch.Tensor,
                       routing_map: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair travels to the expert's rank and its output back."""
        group, n_local = parallel_state.get_expert_model_parallel_group(), self.num_local
        # The pairs in expert order, hence grouped by the rank they go to.
        pair_token, pair_expert = routing_map.t().nonzero(as_tuple=True)[::-1]
        counts = routing_map.sum(dim=0).view(self.ep_size, n_local)  # sent, [rank, expert]
        received = expert_parallel.exchange_counts(counts, group)  # [source, local expert]
        sent, got = counts.tolist(), received.tolist()  # the host needs them: one read each
        send_splits, recv_splits = [sum(r) for r in sent], [sum(r) for r in got]
        arrived = expert_parallel.all_to_all(tokens[pair_token], group, recv_splits, send_splits)
        # Rows arrive by source rank, each source's by local expert: expert j's rows are the
        # j-th block of every source's part.
        starts = [sum(recv_splits[:src]) + sum(got[src][:j]) for src in range(self.ep_size)
                  for j in range(n_local)]
        rows = [torch.cat([torch.arange(starts[src * n_local + j],
                                        starts[src * n_local + j] + got[src][j],
                                        device=tokens.device) for src in range(self.ep_size)])
                for j in range(n_local)]
        outputs = self._run_experts([arrived[idx] for idx in rows])
        done = arrived.new_zeros(arrived.shape).index_add(0, torch.cat(rows), torch.cat(outputs))
        back = expert_parallel.all_to_all(done, group, send_splits, recv_splits)
        weights = probs[pair_token, pair_expert].unsqueeze(1).to(back.dtype)
        return torch.zeros_like(tokens).index_add(0, pair_token, back * weights)

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output ``[s, b, h]``, times ``sigmoid(x . g)`` per token under
        --moe-shared-expert-gate."""
        out = self.shared_experts(x)
        gate = getattr(self.shared_experts, "gate_weight", None)
        if gate is None:
            return out
        return out * torch.sigmoid(F.linear(x, gate))  # [s, b, 1] broadcast over h


def _gate_weight(config: ModelConfig, init: InitRNG, device) -> nn.Parameter:
    """The shared expert's gate ``[1, h]``, initialised as the router is."""
    weight = torch.empty(1, config.hidden_size)
    if init.normal() is not None:
        init.normal()(weight)
    return nn.Parameter(weight.to(device=device, dtype=config.params_dtype))


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The mixture-of-experts layers inside ``model`` (any wrapper), in model order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def set_loss_scale(models: list[nn.Module], scale: float) -> None:
    """Make the router losses' gradients ``scale`` times theirs, as the language-model loss's
    are (1 / micro-batches of the step, times the fp16 loss scale)."""
    for model in models:
        for layer in moe_layers(model):
            layer.router.loss_scale = scale


def update_expert_biases(models: list[nn.Module], rate: float,
                         reduce: Callable[[torch.Tensor], None]) -> None:
    """Loss-free balancing after a step: every layer's bias moves by ``rate`` towards its
    experts with fewer tokens than the mean (``bias += rate * sign(mean - count)``, the counts
    summed by ``reduce`` over every rank that routed tokens), and the counts restart."""
    routers = [layer.router for model in models for layer in moe_layers(model)
               if layer.router.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])  # [layers, E]
    reduce(counts)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    with torch.no_grad():
        for router, step in zip(routers, torch.sign(offset) * rate):
            router.expert_bias.add_(step)
            router.tokens_per_expert.zero_()


EXPERT_LOAD = "expert load imbalance"  # largest share x experts: 1 when balanced
DROPPED = "dropped token fraction"


def expert_share_name(expert: int) -> str:
    """The history's and TensorBoard's name of an expert's share of the routing slots (the
    log line leaves them out: ``is_expert_share``)."""
    return f"expert {expert} token share"


def is_expert_share(name: str) -> bool:
    return name.startswith("expert ") and name.endswith(" token share")


def routing_figures(slots: torch.Tensor, dropped: float, capacity: bool) -> dict[str, float]:
    """From a step's routing slots per expert (all layers and ranks) and its dropped slots:
    each expert's share, the load imbalance (largest share x experts) and, with a capacity,
    the dropped fraction; empty where nothing was routed (a step that computed nothing)."""
    total = float(slots.sum())
    if total == 0:
        return {}
    shares = slots / total
    figures = {EXPERT_LOAD: float(shares.max()) * len(slots)}
    if capacity:
        figures[DROPPED] = dropped / total
    figures.update({expert_share_name(j): float(v) for j, v in enumerate(shares)})
    return figures


def reported_names(config: ModelConfig) -> list[str]:
    """The router losses a model of ``config`` reports in training (the rule ``Router``
    follows), in log order."""
    if config.num_experts is None:
        return []
    kind = config.moe_router_load_balancing_type
    names = []
    if kind != "none" and config.moe_aux_loss_coeff > 0:
        names.append(LOAD_BALANCING if kind == "aux_loss" else SEQ_LOAD_BALANCING)
    if config.moe_z_loss_coeff is not None:
        names.append(Z_LOSS)
    return names


def record_reported(model: nn.Module) -> None:
    """Add each layer's router losses of ``model``'s last forward pass to its totals for the
    step; the training engine calls it once per micro-batch, after the forward step (not
    from the layer, whose recomputation in the backward pass would count twice)."""
    for layer in moe_layers(model):
        router = layer.router
        for name, value in router.reported.items():
            total, passes = router.step_totals.get(name, (0.0, 0))
            router.step_totals[name] = (total + value, passes + 1)


def take_step_totals(models: list[nn.Module]) -> dict[str, tuple[torch.Tensor, int]]:
    """For each router loss recorded this step: (sum over ``models``' layers of each
    layer's mean over its micro-batches, number of layers); the totals are cleared."""
    out: dict[str, tuple[torch.Tensor, int]] = {}
    for model in models:
        for layer in moe_layers(model):
            for name, (total, passes) in layer.router.step_totals.items():
                acc, layers = out.get(name, (0.0, 0))
                out[name] = (acc + total / passes, layers + 1)
            layer.router.step_totals = {}
    return out


def take_step_routing(models: list[nn.Module], num_experts: int) -> torch.Tensor:
    """``[E + 1]``: the step's routing slots per expert summed over ``models``' layers, then
    the dropped slots; the counts are cleared."""
    parts = []
    for model in models:
        for layer in moe_layers(model):
            router = layer.router
            if router.step_slots is not None:
                parts.append(torch.cat([router.step_slots, router.step_dropped.reshape(1)]))
            router.step_slots = router.step_dropped = None
    if not parts:
        return torch.zeros(num_experts + 1)
    return torch.stack(parts).sum(dim=0)  # on the layers' device: read once, by the caller


def reported_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """The router losses of ``model``'s last training forward pass, each averaged over its
    mixture-of-experts layers (Megatron-LM's ``load_balancing_loss`` and ``z_loss``, without
    their coefficients); empty for a dense model or outside training."""
    per_name: dict[str, list[torch.Tensor]] = {}
    for layer in moe_layers(model):
        for name, value in layer.router.reported.items():
            per_name.setdefault(name, []).append(value)
    return {name: torch.stack(values).mean() for name, values in per_name.items()}
