"""The published memory formulas our planner (``megatron.planning.planner``) is checked against, in our
own words, and the comparison ``tools/plan.py --compare-formulas`` prints.

Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), Table 2, bytes per transformer layer for s tokens, micro-batch b, hidden h, a
heads, tensor-parallel size t (16-bit activations, 1-byte dropout masks, FFN 4h)::

    no recomputation        sbh (10 + 24/t + 5as/(ht))      sequence parallel: sbh (34/t + 5as/(ht))
    selective recompute     sbh (10 + 24/t)                 sequence parallel: sbh (34/t)
    full recompute          2 sbh (the layer's input)       sequence parallel: 2 sbh / t

Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` turns the selective rows into
the first pipeline stage's activations: the per-layer figure times all L layers (p
micro-batches in flight on L/p layers), plus the embedding's input (8 s b p bytes) and dropout
mask (s b h p bytes), times ``1 + (p - 1)/(p v)`` for the interleaved schedule, plus the LM
head's inputs when there is one stage; under sequence parallelism all of it over t, without
it the sum times 1.05 (its allowance for temporaries). We use the same assembly for the other
rows (which Megatron-LM does not cover).

Weights and optimizer (Megatron-LM's same file): the most loaded shard's parameters, (L layers
/ p + the word embeddings) / t with 12h^2 + 4h per layer (no biases, no learned positions),
times 18 bytes (fp16 weight, fp32 gradient, fp32 main weight and two Adam moments), or
6 + 12/d with the distributed optimizer over d data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import math

from megatron.config import RunConfig
from megatron.planning.planner import plan_stage


def korthikanti_layer_bytes(config: RunConfig) -> float:
    """One layer's activations for one micro-batch (Table 2 above)."""
    m, p = config.model, config.parallel
    t = p.tensor_model_parallel_size
    sp = p.sequence_parallel and t > 1
    s, b, h, a = m.seq_length, config.training.micro_batch_size, m.hidden_size, \
        m.num_attention_heads
    sbh = s * b * h
    if m.recompute_granularity == "full":
        return 2 * sbh / (t if sp else 1)
    attention = 0.0 if m.recompute_granularity == "selective" else 5 * a * s / (h * t)
    return sbh * ((34 / t if sp else 10 + 24 / t) + attention)


def formula_activations(config: RunConfig) -> float:
    """The first stage's activations, assembled as Megatron-LM does (module docstring)."""
    m, par = config.model, config.parallel
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    v = par.virtual_pipeline_model_parallel_size
    sp = par.sequence_parallel and t > 1
    s, b, h = m.seq_length, config.training.micro_batch_size, m.hidden_size
    total = korthikanti_layer_bytes(config) * m.num_layers * (t if sp else 1)
    total += 8 * s * b * p + s * b * h * p
    if v is not None:
        total *= 1 + (p - 1) / (p * v)
    elif p > 1:
        total *= min(1.0, config.num_microbatches / p)
    if p == 1:
        total += s * b * h * 4 * (1 + m.padded_vocab_size / h)
    return total / t if sp else total * 1.05


def formula_weights_and_optimizer(config: RunConfig) -> float:
    """Weights, gradients and optimizer state of the most loaded shard (module docstring)."""
    m, par = config.model, config.parallel
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    h = m.hidden_size
    per_layer = 2 * h * (m.ffn_hidden_size + 2) + 4 * h * m.projection_size
    block = per_layer * m.num_layers + 2 * h
    embedding = h * m.padded_vocab_size
    shard = (block / p + embedding) / t
    if m.untie_embeddings_and_output_weights and p == 1:
        shard += embedding / t
    d = config.data_parallel_size
    return shard * (6 + 12 / d if config.optimizer.use_distributed_optimizer else 18)


@dataclasses.dataclass(frozen=True)
class FormulaRow:
    label: str
    ours_state: int  # weights + gradients + optimizer
    formula_state: float
    ours_activations: int
    formula_activations: float

    @property
    def ours_total(self) -> int:
        return self.ours_state + self.ours_activations

    @property
    def formula_total(self) -> float:
        return self.formula_state + self.formula_activations


def compare(config: RunConfig, label: str = "") -> FormulaRow:
    """Our planner's first stage (the most loaded, with the most activations) beside the
    formulas."""
    mem = plan_stage(config, 0).memory
    return FormulaRow(label, mem.weights + mem.gradients + mem.optimizer,
                      formula_weights_and_optimizer(config), mem.activations,
                      formula_activations(config))


RECOMPUTE_VARIANTS = {
    "none": dict(recompute_granularity=None),
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1),
}


def variants(config: RunConfig) -> list[tuple[str, RunConfig]]:
    """``config`` with and without sequence parallelism, under each recompute setting."""
    out = []
    tp = config.parallel.tensor_model_parallel_size
    for sp in ((True, False) if tp > 1 else (False,)):
        parallel = dataclasses.replace(config.parallel, sequence_parallel=sp)
        for name, changes in RECOMPUTE_VARIANTS.items():
            cfg = config.replace(parallel=parallel)
            cfg = cfg.replace(model=cfg.model.replace(**changes))
            out.append((f"{'SP' if sp else 'no SP'}, recompute {name}", cfg))
    return out


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _diff(ours: float, formula: float) -> str:
    return f"{100 * (ours - formula) / formula:+.1f}%" if formula else "n/a"


def format_comparison(rows: list[FormulaRow]) -> str:
    """The table README.md shows for the 175B recipe (GB = 2^30 bytes)."""
    head = ("| layout | weights+grads+optimizer: ours / formula | activations: ours / formula "
            "| sum: ours / formula |")
    lines = [head, "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.label} | {_gb(r.ours_state)} / {_gb(r.formula_state)} "
            f"({_diff(r.ours_state, r.formula_state)}) | {_gb(r.ours_activations)} / "
            f"{_gb(r.formula_activations)} ({_diff(r.ours_activations, r.formula_activations)})"
            f" | {_gb(r.ours_total)} / {_gb(r.formula_total)} "
            f"({_diff(r.ours_total, r.formula_total)}) |")
    return "\n".join(lines)


def differences_above(row: FormulaRow, limit: float = 0.05) -> set[str]:
    """Which of the row's figures differ from the formula's by more than ``limit``."""
    out = set()
    for name, ours, formula in (("state", row.ours_state, row.formula_state),
                                ("activations", row.ours_activations, row.formula_activations)):
        if not math.isclose(ours, formula, rel_tol=limit):
            out.add(name)
    return out
