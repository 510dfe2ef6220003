"""The rehearsal (megatron/rehearsal) at small layouts: the fake backend is faithful (a real
gloo run of the same command issues the same operations in the same order), and planted
faults (a stage that skips a send, a data-parallel rank that reduces a bucket of another size)
are caught and named by the checker.

The GPT-3 175B recipe's own rehearsals (64 and 128 ranks, interleaved) are in
tests/functional/test_rehearse_gpt3.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist

from megatron.config import parse_args
from megatron.planning.rehearsal.entry import rehearse
from megatron.planning.rehearsal.ranks import RankGrid, plan_ranks
from megatron.planning.rehearsal.recorder import Recorder, installed
from megatron.planning.rehearsal.runner import run_planned_ranks, run_rank
from megatron.planning.rehearsal.setup import rehearsal_config
from megatron.training import RunCallbacks, rank_starter
from tests.dist_utils import run_distributed

FLAGS = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--log-interval", "10",
    "--eval-interval", "100", "--eval-iters", "1", "--clip-grad", "1.0",
]
# Tensor 2 x pipeline 2 with sequence parallelism, and pipeline 2 x data 2 with the
# distributed optimizer: between them every kind of operation a step issues.
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--sequence-parallel"]
PP2_DP2 = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
# Context parallelism: the ring's sends (with pipeline 2) and the all-to-alls (with tensor 2).
CP2_PP2 = ["--context-parallel-size", "2", "--attention-dropout", "0",
           "--pipeline-model-parallel-size", "2"]
CP2_A2A_TP2 = ["--context-parallel-size", "2", "--cp-comm-type", "a2a",
               "--tensor-model-parallel-size", "2"]
# Expert parallel 2: all-to-all over data 4 with the distributed optimizer (6 experts: 32
# routing slots of 16 tokens give uneven splits, 17 and 15 rows), and all-gather with tensor 2
# and sequence parallelism (experts' gradients over expert-data ranks of 1).
MOE = ["--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
EP2_A2A = [*MOE, "--num-experts", "6", "--expert-model-parallel-size", "2",
           "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer"]
EP2_AG_TP2 = [*MOE, "--num-experts", "4", "--moe-expert-parallel-size", "2",
              "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _start():
    return rank_starter(_callbacks())


def _callbacks() -> RunCallbacks:
    import pretrain_gpt

    return RunCallbacks(pretrain_gpt.train_valid_test_datasets_provider,
                        pretrain_gpt.model_provider, pretrain_gpt.forward_step)


def _rehearsed(world: int, layout: list[str]):
    cfg = parse_args([*FLAGS, *layout, "--rehearse"], world_size=world)
    return cfg, rehearsal_config(cfg)


def _tokenizer(cfg):
    from megatron.assembly.build import build_run_tokenizer

    return build_run_tokenizer(cfg)


def _record_over_gloo(rank: int, world: int, layouts: list[list[str]]):
    """This gloo rank's operations for each layout, recorded as the rehearsal records them."""
    from megatron.core import parallel_state

    out = []
    for layout in layouts:
        cfg, rehearsed = _rehearsed(world, layout)
        recorder = Recorder()
        with installed(recorder):
            out.append(run_rank(rehearsed, _tokenizer(cfg), _start(), recorder).ops)
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_the_fake_backend_records_what_a_gloo_run_of_the_same_command_issues():
    layouts = [TP2_PP2, PP2_DP2, CP2_PP2, CP2_A2A_TP2]
    # Forked: this process has imported everything the ranks need, and holds no process group.
    real = run_distributed(_record_over_gloo, 4, layouts)
    for i, layout in enumerate(layouts):
        cfg, rehearsed = _rehearsed(4, layout)
        p = cfg.parallel
        grid = RankGrid(p.tensor_model_parallel_size, cfg.data_parallel_size,
                        p.pipeline_model_parallel_size, p.context_degree)
        fake = {r.rank: r.ops for r in run_planned_ranks(
            rehearsed, _tokenizer(cfg), _start(), plan_ranks(grid, "all"))}
        for rank in range(4):
            assert len(fake[rank]) > 25
            assert fake[rank] == real[rank][i], (layout, rank)
        kinds = {o.op for ops in fake.values() for o in ops if o.phase == "iteration"}
        assert {"send", "recv", "all_reduce"} <= kinds or layout is CP2_A2A_TP2
        if layout is PP2_DP2:
            assert ("all_gather_into_tensor" in kinds) and ("reduce_scatter_tensor" in kinds)
        if layout is CP2_A2A_TP2:
            assert "all_to_all_single" in kinds


def _grid(cfg) -> RankGrid:
    p = cfg.parallel
    return RankGrid(p.tensor_model_parallel_size, cfg.data_parallel_size,
                    p.pipeline_model_parallel_size, p.context_degree,
                    p.expert_model_parallel_size)


def test_the_fake_backend_records_what_a_gloo_run_of_an_expert_parallel_command_issues():
    """Every all-to-all and all-gather of the expert groups, with its split sizes, and the
    expert-data reductions, as a gloo run of the same command issues them (both route as
    the rehearsal routes); every rank's run is matched by the checker too."""
    from megatron.planning.rehearsal.checker import check

    layouts = [EP2_A2A, EP2_AG_TP2]
    real = run_distributed(_record_over_gloo, 4, layouts)
    for i, layout in enumerate(layouts):
        cfg, rehearsed = _rehearsed(4, layout)
        plan = plan_ranks(_grid(cfg), "all")
        fake = {r.rank: r.ops for r in run_planned_ranks(
            rehearsed, _tokenizer(cfg), _start(), plan)}
        for rank in range(4):
            assert fake[rank] == real[rank][i], (layout, rank)
        assert check(plan, fake, {r: [] for r in range(4)}) == []
        dispatch = [o for o in fake[0] if "expert_parallel.py" in o.site]
        kinds = {o.op for o in dispatch}
        if layout is EP2_A2A:
            assert kinds == {"all_to_all_single"}
            # rank 0 holds experts 0-2 (6 + 6 + 5 of the 32 slots of each rank: 17 rows from
            # each), and sends its 17 and 15 rows.
            assert ((17, 15), (17, 17)) in {o.splits for o in dispatch}
        else:
            assert kinds == {"all_gather_into_tensor", "reduce_scatter_tensor"}
            assert {o.group for o in dispatch} == {(0, 2)}  # rank 0's expert group


def test_expert_parallel_launches_rehearse_in_classes_mode(capsys):
    """Tensor 2 x data 4 with expert parallel 2 (8 ranks, all-to-all): the last rank of the
    stage (expert 1 of expert-data 1) issues the first one's operations moved, the all-to-
    alls fit, and the dispatch's recorded bytes are the planner's."""
    layout = [*MOE, "--num-experts", "4", "--expert-model-parallel-size", "2",
              "--moe-token-dispatcher-type", "alltoall", "--tensor-model-parallel-size", "2",
              "--sequence-parallel"]
    status, text = _rehearse_with(8, layout, None, capsys)
    assert status == 0, text
    assert ("tensor 2 x pipeline 1 x data 4 = 8 ranks, sequence parallel, expert parallel 2 "
            "within data (alltoall)") in text
    check = next(line for line in text.splitlines()
                 if line.startswith("  rank 0 (stage 0, tensor 0, data 0, expert 0): weights"))
    assert "tp all-reduce 1.000" in check and "ep dispatch 1.000" in check, check


def _rehearse_with(world: int, layout: list[str], around_rank, capsys) -> tuple[int, str]:
    cfg = parse_args([*FLAGS, *layout, "--rehearse"], world_size=world)
    status = rehearse(cfg, _start(), around_rank)
    out = capsys.readouterr()
    return status, out.out + out.err


def _on_rank(target: int, patch):
    """around_rank: ``patch()`` (a context manager) on rank ``target`` only."""
    return lambda rank: patch() if rank == target else contextlib.nullcontext()


@contextlib.contextmanager
def _skip_second_forward_send():
    from megatron.core.pipeline_parallel import p2p_communication

    original = p2p_communication.P2PCommunicator.exchange
    calls = {"sends": 0}

    def exchange(self, *, send_next=None, **kwargs):
        if send_next is not None:
            calls["sends"] += 1
            if calls["sends"] == 2:
                send_next = None  # the planted fault: this activation never leaves
        return original(self, send_next=send_next, **kwargs)

    p2p_communication.P2PCommunicator.exchange = exchange
    try:
        yield
    finally:
        p2p_communication.P2PCommunicator.exchange = original


@contextlib.contextmanager
def _reduce_a_shorter_bucket():
    from megatron.core.distributed import param_and_grad_buffer as buffers

    original = buffers.reduce_scatter_flat

    def shorter(output, data, group, async_op=False):
        # The planted fault: this rank's reduce-scatter covers one element per rank fewer.
        n = dist.get_world_size(group)
        return original(output[:-1], data[:-n], group, async_op)

    buffers.reduce_scatter_flat = shorter
    try:
        yield
    finally:
        buffers.reduce_scatter_flat = original


@pytest.mark.slow
def test_a_stage_that_skips_a_send_is_caught_and_named(capsys):
    # Pipeline 4 x data 2 = 8 ranks; stage 1's first rank (global rank 2) drops its second
    # forward send.
    layout = ["--pipeline-model-parallel-size", "4", "--rehearse-ranks", "all"]
    status, text = _rehearse_with(8, layout, _on_rank(2, _skip_second_forward_send), capsys)
    assert status == 1
    assert "error: the ranks' communication does not fit together" in text
    assert ("rank 4 (stage 2, tensor 0, data 0) receives from rank 2 (tag 1) a message #3 "
            "that is never sent") in text
    assert "p2p_communication.py" in text and "receive #3 recv 16x1x32 float32" in text
    assert "would wait forever" not in text.split("error:")[1].splitlines()[0]


@pytest.mark.slow
def test_a_data_parallel_rank_reducing_another_bucket_size_is_caught_and_named(capsys):
    status, text = _rehearse_with(4, PP2_DP2 + ["--rehearse-ranks", "all"],
                                  _on_rank(1, _reduce_a_shorter_bucket), capsys)
    assert status == 1
    lines = text.split("error: ")[1].splitlines()
    assert lines[0].startswith("the ranks' communication does not fit together")
    assert lines[1].startswith("the data group [0, 1] diverges at its operation #")
    assert lines[2].startswith("  rank 0 (stage 0, tensor 0, data 0): #")
    assert lines[3].startswith("  rank 1 (stage 0, tensor 0, data 1): #")
    assert "reduce_scatter_tensor" in lines[2] and "param_and_grad_buffer.py" in lines[3]
    sizes = [int(line.split("reduce_scatter_tensor ")[1].split()[0]) for line in lines[2:4]]
    assert sizes[0] - sizes[1] == 2


@pytest.mark.slow
def test_classes_mode_checks_that_a_stages_ranks_are_alike(capsys):
    # Tensor 2 x pipeline 2 x data 2: per stage only the first and the last rank run; a fault
    # on stage 1's last rank (global 7) makes the stage's ranks unlike.
    status, text = _rehearse_with(8, TP2_PP2 + ["--use-distributed-optimizer"],
                                  _on_rank(7, _reduce_a_shorter_bucket), capsys)
    assert status == 1
    assert "4 ranks run (the first rank of each stage, and the last of stages 0, 1 to" in text
    assert "the ranks of pipeline stage 1 are not alike" in text
    assert "rank 4 (stage 1, tensor 0, data 0): #" in text
    assert "rank 7 (stage 1, tensor 1, data 1): #" in text


@pytest.fixture(autouse=True)
def _no_process_group_left():
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize("extra, world, env, expected", [
    (TP2_PP2 + ["--rehearse-hidden-size", "30"], 4, {},
     "error: --rehearse-hidden-size (30) must be a multiple of --num-attention-heads (4)"),
    (["--pipeline-model-parallel-size", "2", "--deepspeed"], 4, {},
     "error: --rehearse runs the built-in engine; DeepSpeed's engine"),
    (TP2_PP2, 4, {"RANK": "0"}, "error: --rehearse runs every rank in this one process"),
])
def test_what_the_rehearsal_cannot_run_is_one_line_and_status_2(extra, world, env, expected,
                                                                 monkeypatch, capsys):
    import pretrain_gpt

    monkeypatch.setenv("WORLD_SIZE", str(world))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main([*FLAGS, *extra, "--rehearse"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(expected) and err.count("\n") == 1, err


@pytest.mark.slow
def test_a_rank_whose_own_code_fails_is_named(capsys):
    @contextlib.contextmanager
    def broken_loss():
        import pretrain_gpt

        original = pretrain_gpt.loss_func
        pretrain_gpt.loss_func = lambda *args, **kwargs: 1 / 0
        try:
            yield
        finally:
            pretrain_gpt.loss_func = original

    with pytest.raises(SystemExit) as exit_info:
        cfg = parse_args([*FLAGS, *TP2_PP2, "--rehearse"], world_size=4)
        rehearse(cfg, _start(), _on_rank(3, broken_loss))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert ("error: rank 3 (stage 1, tensor 1, data 0) failed in its iteration: "
            "ZeroDivisionError: division by zero (at ") in err


def test_context_parallel_launches_rehearse_in_classes_mode(capsys):
    """Context 2 x data 2 x pipeline 2 (8 ranks): the ring's sends and receives match, and
    the classes mode's claim holds for the context ranks (the last rank of a stage, context 1
    and data 1, issues the first rank's operations moved)."""
    layout = [*CP2_PP2, "--use-distributed-optimizer"]
    status, text = _rehearse_with(8, layout, None, capsys)
    assert status == 0, text
    assert "tensor 1 x pipeline 2 x context 2 (p2p) x data 2 = 8 ranks" in text
