"""Planning mixtures of experts (megatron/planning/experts.py) on hand-checked shapes: the
rows each expert computes under the rehearsal's balanced routing, as the real router and its
capacity code produce them, and the dispatch's bytes; the Mixtral 8x7B shape's published
parameter counts and its plan."""

from __future__ import annotations

import pytest
import torch

from megatron.config import parse_args
from megatron.model import moe
from megatron.model.init import InitRNG
from megatron.planning import experts
from megatron.planning.rehearsal.routing import balanced_routing
from tests.distributed.training_utils import load_tool

SMALL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
         "--seq-length", "7", "--max-position-embeddings", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-experts", "4",
         "--moe-router-topk", "3"]


@pytest.mark.parametrize("extra", [
    (), ("--moe-expert-capacity-factor", "0.5"),
    ("--moe-expert-capacity-factor", "0.5", "--moe-pad-expert-input-to-capacity"),
    ("--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position"),
    ("--moe-expert-capacity-factor", "2", "--moe-pad-expert-input-to-capacity")],
    ids=["dropless", "capacity", "padded", "position", "padded-all"])
def test_balanced_routing_gives_the_planned_rows_through_the_real_router(extra):
    """T = 7 x 2 tokens, top-3 of 4: 42 slots, experts 0 and 1 get 11, 2 and 3 get 10 (the
    nearest integers); capacity ceil(42/4 x 0.5) = 6 keeps 6 of each; padded to capacity
    every expert computes 6; a capacity above T keeps (padded: computes) every token."""
    cfg = parse_args([*SMALL, *extra], world_size=1)
    router = moe.Router(cfg.model, InitRNG(cfg.model, "router")).train()
    tokens = torch.randn(14, 16)
    with balanced_routing():
        probs, routing_map = router(tokens, 7)
    assert routing_map.sum(0).tolist() == experts.expert_rows(cfg)
    expected = {(): [11, 11, 10, 10], ("--moe-expert-capacity-factor", "2",
                                       "--moe-pad-expert-input-to-capacity"): [14] * 4}
    assert experts.expert_rows(cfg) == expected.get(extra, [6] * 4)
    # The router's own scores: the softmax over the chosen logits is left as it was.
    if not extra:
        logits = torch.nn.functional.linear(tokens, router.weight)
        chosen = logits.gather(1, routing_map.nonzero()[:, 1].view(14, 3))
        assert torch.allclose(probs[routing_map].view(14, 3), chosen.softmax(-1))
    assert moe.route.__name__ == "route"  # restored


def test_dispatch_bytes_follow_the_formula():
    """Expert parallel 2, alltoall: P = 42 pairs sent, R = 2 x (11 + 11) = 44 computed on
    expert rank 0, fp32: forward (P + R) h 4 + 8 E, backward (P + R) h 4; allgather:
    forward 2 n T h 4 + 5 n T E, backward 2 n T h 4 + 4 n T E."""
    ep = ["--expert-model-parallel-size", "2"]
    a2a = parse_args([*SMALL, *ep, "--moe-token-dispatcher-type", "alltoall"], world_size=2)
    assert experts.sent_and_computed_rows(a2a) == (42, 44)
    assert experts.dispatch_bytes_per_layer(a2a) == (86 * 16 * 4 + 32, 86 * 16 * 4)
    gather = parse_args([*SMALL, *ep], world_size=2)
    assert experts.dispatch_bytes_per_layer(gather) == (2 * 2 * 14 * 16 * 4 + 5 * 2 * 14 * 4,
                                                        2 * 2 * 14 * 16 * 4 + 4 * 2 * 14 * 4)
    assert experts.dispatch_bytes_per_layer(parse_args(SMALL, world_size=1)) == (0, 0)


MIXTRAL = [
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--seq-length", "4096", "--max-position-embeddings", "32768", "--normalization", "RMSNorm",
    "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--vocab-size", "32000",
    "--micro-batch-size", "1", "--global-batch-size", "256", "--bf16",
    "--use-distributed-optimizer", "--tensor-model-parallel-size", "8", "--sequence-parallel",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
    "--moe-token-dispatcher-type", "alltoall", "--world-size", "64", "--gpu-memory-gb", "80",
]


def test_mixtral_8x7b_counts_as_published_and_plans_its_64_gpu_layout(capsys):
    """Mixtral 8x7B: 46,702,792,704 parameters, 12,879,925,248 active per token (Mistral's
    figures; vocabulary 32000 kept unpadded with --make-vocab-size-divisible-by 125 x tensor
    8). Expert parallel 8 puts one expert of each layer on a rank; the all-to-all carries
    2 x (8192 + 8192) rows of 4096 bf16 per MoE layer and micro-batch, 256 MiB."""
    tool = load_tool("plan")
    plan = tool.main([*MIXTRAL, "--make-vocab-size-divisible-by", "125",
                      "--expert-model-parallel-size", "8"])
    out = capsys.readouterr().out
    assert plan.total_params == plan.closed_form_params == 46_702_792_704
    assert plan.active_params == 12_879_925_248
    assert "46,702,792,704 in total, 12,879,925,248 active per token" in out
    assert ("tensor 8 x pipeline 1 x data 8 = 64 GPUs, sequence parallel, expert parallel 8 "
            "within data (alltoall)") in out
    [stage] = plan.stages
    expert = 3 * 4096 * 14336 // 8  # one expert's share on a tensor rank
    assert stage.experts_per_rank == (32 * expert,) * 8
    assert "experts: 8 in each of 32 MoE layers, top-2, 1 per rank (expert parallel 8); " \
        "256.00 MB handed to the alltoall" in out
    assert plan.fits
    # Without expert parallelism each rank holds all 8 experts: 8 x the expert state.
    whole = tool.main([*MIXTRAL, "--make-vocab-size-divisible-by", "125"])
    capsys.readouterr()
    assert whole.stages[0].experts_per_rank == (0,) * 8  # not expert-parallel: reduced as dense
    assert whole.stages[0].params_per_rank[0] - stage.params_per_rank[0] == 7 * 32 * expert
