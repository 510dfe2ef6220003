"""The rehearsal's checker on hand-made records: what matching groups and channels alone cannot
see (a hang from the order of otherwise matching operations, an async request never waited),
and how classes of alike ranks are planned and moved."""

from __future__ import annotations

from megatron.planning.rehearsal.checker import check
from megatron.planning.rehearsal.ranks import RankGrid, plan_ranks
from megatron.planning.rehearsal.records import CommOp

GRID = RankGrid(tp=1, dp=2, pp=1)  # two ranks, one data-parallel group
PLAN = plan_ranks(GRID, "all")


def _op(op: str, group=(0, 1), peer=None, batch=0, shape=(4,)) -> CommOp:
    detail = "tag 1" if op in ("send", "recv") else "SUM"
    return CommOp(op, group, peer, shape, "float32", 16, detail, f"site of {op}", "iteration",
                  batch)


def test_matching_programs_pass():
    ops = {0: [_op("all_reduce"), _op("send", peer=1, batch=1), _op("recv", peer=1, batch=2)],
           1: [_op("all_reduce"), _op("recv", peer=0, batch=1), _op("send", peer=0, batch=2)]}
    assert check(PLAN, ops, {0: [], 1: []}) == []


def test_both_ranks_receiving_first_is_a_hang_though_every_send_has_its_receive():
    ops = {0: [_op("recv", peer=1, batch=1), _op("send", peer=1, batch=2)],
           1: [_op("recv", peer=0, batch=1), _op("send", peer=0, batch=2)]}
    findings = check(PLAN, ops, {0: [], 1: []})
    assert [f.check for f in findings] == ["waiting"]
    assert "2 rank(s) would wait forever" in findings[0].text
    assert "rank 0 (stage 0, tensor 0, data 0): step #0 recv 4 float32 tag 1 from 1" \
        in findings[0].text


def test_sends_and_receives_posted_together_do_not_hang():
    ops = {0: [_op("recv", peer=1, batch=1), _op("send", peer=1, batch=1)],
           1: [_op("recv", peer=0, batch=1), _op("send", peer=0, batch=1)]}
    assert check(PLAN, ops, {0: [], 1: []}) == []


def test_collectives_in_a_cycle_of_groups_hang_though_each_group_agrees():
    plan = plan_ranks(RankGrid(tp=1, dp=3, pp=1), "all")
    a, b, c = (0, 1), (1, 2), (0, 2)
    ops = {0: [_op("all_reduce", a), _op("all_reduce", c)],
           1: [_op("all_reduce", b), _op("all_reduce", a)],
           2: [_op("all_reduce", c), _op("all_reduce", b)]}
    findings = check(plan, ops, {r: [] for r in range(3)})
    assert [f.check for f in findings] == ["waiting"]  # every group's sequence matches
    assert "3 rank(s) would wait forever" in findings[0].text
    in_order = {0: [_op("all_reduce", a), _op("all_reduce", c)],
                1: [_op("all_reduce", a), _op("all_reduce", b)],
                2: [_op("all_reduce", c), _op("all_reduce", b)]}
    assert check(plan, in_order, {r: [] for r in range(3)}) == []


def test_a_shape_mismatch_names_the_group_and_both_sites():
    ops = {0: [_op("all_reduce")], 1: [_op("all_reduce", shape=(5,))]}
    [finding] = check(PLAN, ops, {0: [], 1: []})
    assert finding.check == "collective"
    assert finding.text.splitlines() == [
        "the data group [0, 1] diverges at its operation #0:",
        "  rank 0 (stage 0, tensor 0, data 0): #0 all_reduce 4 float32 SUM at site of all_reduce",
        "  rank 1 (stage 0, tensor 0, data 1): #0 all_reduce 5 float32 SUM at site of all_reduce"]


def _all_to_all(sent: tuple[int, ...], received: tuple[int, ...]) -> CommOp:
    return CommOp("all_to_all_single", (0, 1), None, (sum(sent), 8), "float32",
                  sum(sent) * 32, "", "site of all_to_all", "iteration", 0, (sent, received))


def test_an_all_to_all_whose_splits_do_not_fit_names_the_rows():
    """Members may hand an all-to-all inputs of other lengths (the expert dispatch); what
    must agree is that each sends every other what that one expects from it."""
    fits = {0: [_all_to_all((3, 5), (3, 2))], 1: [_all_to_all((2, 4), (5, 4))]}
    assert check(PLAN, fits, {0: [], 1: []}) == []
    bad = {0: [_all_to_all((3, 5), (3, 2))], 1: [_all_to_all((2, 4), (6, 4))]}
    [finding] = check(PLAN, bad, {0: [], 1: []})
    assert finding.check == "collective"
    assert finding.text.splitlines() == [
        "the all-to-all #0 of the data group [0, 1] does not fit: rank 0 sends rank 1 5 rows, "
        "which expects 6 from it:",
        "  rank 0 (stage 0, tensor 0, data 0): #0 all_to_all_single 8x8 float32 rows to 3,5 "
        "from 3,2 at site of all_to_all",
        "  rank 1 (stage 0, tensor 0, data 1): #0 all_to_all_single 6x8 float32 rows to 2,4 "
        "from 6,4 at site of all_to_all"]


def test_the_mover_keeps_expert_groups_whole_and_turns_their_splits():
    """tensor 2 x data 4 with expert parallel 2: rank 0 moved to the last rank (data 3 =
    expert-data 1, expert 1) sends its expert group onto the last one and its expert-data
    group onto that of expert 1; an all-to-all's splits follow their members."""
    grid = RankGrid(tp=2, dp=4, pp=1, ep=2)
    groups = grid.groups()
    assert groups.expert[:2] == [[0, 2], [4, 6]] and groups.expert_data[:2] == [[0, 4], [2, 6]]
    move = grid.mover(0, 7)
    assert sorted(move(r) for r in (0, 2)) == [5, 7]  # expert group of rank 7
    assert sorted(move(r) for r in (0, 4)) == [3, 7]  # its expert-data group
    assert grid.describe(7) == "rank 7 (stage 0, tensor 1, data 3, expert 1)"
    op = CommOp("all_to_all_single", (0, 2), None, (5, 8), "float32", 160, "", "s",
                "iteration", 0, ((2, 3), (2, 4)))
    moved = op.moved(move)  # 0 -> 7, 2 -> 5: the members' order turns
    assert moved.group == (5, 7) and moved.splits == ((3, 2), (4, 2))
    plan = plan_ranks(grid, "classes")
    assert plan.checks == ((0, 7),)


def test_an_unwaited_request_is_reported():
    ops = {0: [_op("all_reduce")], 1: [_op("all_reduce")]}
    [finding] = check(PLAN, ops, {0: [], 1: [ops[1][0]]})
    assert finding.check == "unwaited"
    assert "rank 1 (stage 0, tensor 0, data 1) started 1 asynchronous operation(s)" \
        in finding.text


def test_classes_run_each_stages_first_rank_and_check_three_stages():
    grid = RankGrid(tp=8, dp=2, pp=8)
    plan = plan_ranks(grid, "classes")
    assert plan.run[0] == grid.rank(7, 0, 0)  # the last stage first
    assert len(plan.run) == 11 and plan.derived == 128 - 11
    assert sorted(grid.coords(last)[0] for _, last in plan.checks) == [0, 1, 7]
    # rank (stage 3, data 1, tensor 5) issues stage 3's first rank's operations, moved
    member = grid.rank(3, 1, 5)
    assert plan.source[member] == grid.rank(3, 0, 0)
    move = grid.mover(grid.rank(3, 0, 0), member)
    op = _op("send", group=tuple(grid.groups().containing("pipeline", grid.rank(3, 0, 0))),
             peer=grid.rank(4, 0, 0))
    moved = op.moved(move)
    assert moved.peer == grid.rank(4, 1, 5)
    assert moved.group == tuple(grid.groups().containing("pipeline", member))


def test_the_rehearsed_iteration_is_the_runs_first_or_at_the_full_batch():
    from megatron.config import parse_args
    from megatron.planning.rehearsal.facts import iteration_microbatches
    from megatron.planning.rehearsal.setup import rehearsal_config

    flags = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
             "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536",
             "--rampup-batch-size", "16", "16", "5859375", "--train-samples", "146484375",
             "--lr", "6e-5", "--fp16", "--tensor-model-parallel-size", "8",
             "--pipeline-model-parallel-size", "8", "--sequence-parallel",
             "--mock-data", "--vocab-size", "50257", "--rehearse-hidden-size", "96",
             "--rehearse-seq-length", "8", "--rehearse"]
    first = rehearsal_config(parse_args(flags, world_size=64))
    full = rehearsal_config(parse_args([*flags, "--rehearse-full-batch"], world_size=64))
    assert (iteration_microbatches(first), iteration_microbatches(full)) == (16, 1536)
    m = first.model
    assert (m.num_layers, m.num_attention_heads, m.hidden_size, m.ffn_hidden_size,
            m.kv_channels, m.seq_length) == (96, 96, 96, 384, 1, 8)
    assert first.optimizer.initial_loss_scale == 1.0 and first.data.mock_data
    assert first.checkpoint.load is None and first.training.exit_interval == 1
