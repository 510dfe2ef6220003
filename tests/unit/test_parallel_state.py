import pytest

from megatron.config import ConfigError, ParallelConfig
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import build_rank_groups
from tests.dist_utils import run_distributed


def _rank_of(tp_rank, dp_rank, pp_rank, tp, dp):
    return pp_rank * tp * dp + dp_rank * tp + tp_rank


@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (64, 8, 8), (128, 8, 8), (16, 4, 1), (6, 1, 3)])
def test_groups_follow_megatron_rank_order(world, tp, pp):
    g = build_rank_groups(world, tp, pp)
    dp = world // (tp * pp)
    assert len(g.tensor) == world // tp and len(g.pipeline) == world // pp
    assert len(g.data) == world // dp and len(g.model) == dp
    for kind, size in [("tensor", tp), ("pipeline", pp), ("data", dp), ("model", tp * pp)]:
        groups = getattr(g, kind)
        assert all(len(x) == size for x in groups), kind
        # each kind partitions the world
        assert sorted(r for x in groups for r in x) == list(range(world)), kind
    for r in range(world):
        tp_rank, dp_rank, pp_rank = r % tp, (r // tp) % dp, r // (tp * dp)
        assert r == _rank_of(tp_rank, dp_rank, pp_rank, tp, dp)
        assert g.containing("tensor", r) == [_rank_of(t, dp_rank, pp_rank, tp, dp) for t in range(tp)]
        assert g.containing("data", r) == [_rank_of(tp_rank, d, pp_rank, tp, dp) for d in range(dp)]
        assert g.containing("pipeline", r) == [_rank_of(tp_rank, dp_rank, p, tp, dp) for p in range(pp)]
        model = g.containing("model", r)
        assert model == sorted(_rank_of(t, dp_rank, p, tp, dp) for t in range(tp) for p in range(pp))
    for pipe, emb, pos in zip(g.pipeline, g.embedding, g.position_embedding):
        assert emb == ([pipe[0], pipe[-1]] if pp > 1 else [pipe[0]])
        assert pos == [pipe[0]]


def test_gpt3_175b_layout_specifics():
    g = build_rank_groups(64, 8, 8)
    assert g.tensor[0] == list(range(8))
    assert g.pipeline[0] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert g.embedding[3] == [3, 59]
    assert g.data[0] == [0]  # dp = 1


def test_indivisible_world_size_names_numbers():
    with pytest.raises(ValueError, match=r"\(12\).*\(8\).*\(1\)"):
        build_rank_groups(12, 8, 1)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        ParallelConfig(world_size=6, tensor_model_parallel_size=4)


def _accessors(rank, world_size):
    ps.initialize_model_parallel(2, 2)
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    out = dict(
        tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        dp=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        first=ps.is_pipeline_first_stage(), last=ps.is_pipeline_last_stage(),
        emb=ps.is_rank_in_embedding_group(), next=ps.get_pipeline_model_parallel_next_rank(),
        prev=ps.get_pipeline_model_parallel_prev_rank(), tp_sum=t.item(),
        src=ps.get_tensor_model_parallel_src_rank(),
    )
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    return out


def test_initialize_on_8_gloo_ranks():
    res = run_distributed(_accessors, 8)
    for r, o in enumerate(res):
        tp_rank, dp_rank, pp_rank = r % 2, (r // 2) % 2, r // 4
        assert o["tp"] == (tp_rank, 2) and o["dp"] == (dp_rank, 2) and o["pp"] == (pp_rank, 2)
        assert o["first"] == (pp_rank == 0) and o["last"] == (pp_rank == 1)
        assert o["emb"]  # pp=2: every rank is on the first or the last stage
        assert o["next"] == (r + 4) % 8 and o["prev"] == (r - 4) % 8
        pair = r - tp_rank
        assert o["tp_sum"] == pair + pair + 1 and o["src"] == pair


def test_expert_groups_follow_megatron_cores_tp_ep_dp_order():
    """8 ranks, tensor 2, expert 2: megatron-core's expert groups (rank = t + 2e + 4d) for
    experts cut over the tensor ranks."""
    groups = build_rank_groups(8, 2, expert_model_parallel_size=2)
    assert groups.expert == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups.expert_data == [[0, 4], [2, 6], [1, 5], [3, 7]]
    single = build_rank_groups(4, expert_model_parallel_size=1)
    assert single.expert == [[0], [1], [2], [3]] and single.expert_data == single.data
    with pytest.raises(ValueError, match="not divisible by the expert-model-parallel size"):
        build_rank_groups(4, 2, expert_model_parallel_size=4)
