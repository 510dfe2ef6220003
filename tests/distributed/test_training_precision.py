"""bf16 and fp16 training through the real pretrain() entry on CPU.

A tiny GPT on real tokens: under --bf16 and --fp16 the model really runs in half precision,
tracks the fp32 run closely, and learns. An inf injected into one iteration's loss under fp16
skips that step (weights and LR schedule untouched), backs the loss scale off as --hysteresis
says, and the log line says so; on two data-parallel ranks an inf on one rank skips the step
on both.
"""

import math

import pytest
import torch

import pretrain_gpt
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import (
    base_argv,
    build_small_corpus,
    captured_stdout,
    parse_log_lines,
)

ITERS = 10
FP16 = {"--fp16": True, "--initial-loss-scale": 1024, "--loss-scale-window": 1000}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("corpus")))


class Probe:
    """A forward_step for pretrain(): pretrain_gpt's, plus a record of the model's dtype and
    of a parameter checksum before each iteration, and an inf multiplied into the loss of the
    first micro-batch of the chosen iterations (1-based) on this rank."""

    def __init__(self, micro_batches_per_iteration: int, poison_iterations=()) -> None:
        self.micro = micro_batches_per_iteration
        self.poison = set(poison_iterations)
        self.calls = 0
        self.dtypes: set = set()
        self.checksums: list[float] = []

    def __call__(self, ctx, data_iterator, model, stage):
        iteration, index = divmod(self.calls, self.micro)
        self.calls += 1
        if index == 0:
            self.checksums.append(sum(p.detach().double().sum().item()
                                      for p in model.parameters()))
        self.dtypes.update(p.dtype for p in model.parameters())
        output, loss_func = pretrain_gpt.forward_step(ctx, data_iterator, model, stage)
        if index == 0 and iteration + 1 in self.poison:
            def poisoned(out):
                loss, reported = loss_func(out)
                return loss * math.inf, reported
            return output, poisoned
        return output, loss_func


def _run(argv, probe: Probe) -> dict:
    with captured_stdout() as out:
        state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                         pretrain_gpt.model_provider, probe, argv=argv)
    return dict(losses=[h["losses"].get("lm loss") for h in state.history],
                skipped=[h["skipped"] for h in state.history],
                scales=[h["loss_scale"] for h in state.history],
                log=out.getvalue(), log_lines=parse_log_lines(out.getvalue()),
                dtypes=sorted(str(d) for d in probe.dtypes), checksums=probe.checksums)


def _single_process_runs(rank, world_size, corpus, cache):
    # One spawned process runs them all: start-up costs more than these tiny runs.
    runs = {
        "fp32": ({}, ()),
        "bf16": ({"--bf16": True}, ()),
        "fp16": (FP16, ()),
        "fp16-inf": ({**FP16, "--hysteresis": 1}, (4,)),
    }
    micro = 2  # global batch 4 = 2 micro-batches of 2
    return {name: _run(base_argv(corpus, cache, **flags), Probe(micro, poison))
            for name, (flags, poison) in runs.items()}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return run_distributed(_single_process_runs, 1, corpus, cache)[0]


def _falls(losses):
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_trains_close_to_fp32(runs, name, dtype):
    run, ref = runs[name], runs["fp32"]
    assert run["dtypes"] == [str(dtype)], "the model does not run in half precision"
    assert ref["dtypes"] == ["torch.float32"]
    _falls(run["losses"])
    _falls(ref["losses"])
    assert not any(run["skipped"])
    # Half precision rounds: close to fp32, but not the same numbers.
    for got, want in zip(run["losses"], ref["losses"]):
        assert abs(got - want) < 2e-2 * want, (run["losses"], ref["losses"])
    assert run["losses"] != ref["losses"]


def test_half_precision_on_cpu_warns(runs):
    for name in ("bf16", "fp16"):
        assert "WARNING: --bf16/--fp16 on a CPU" in runs[name]["log"]
    assert "WARNING: --bf16/--fp16" not in runs["fp32"]["log"]


def test_fp16_log_line_shows_loss_scale(runs):
    lines = runs["fp16"]["log_lines"]
    assert [line["iteration"] for line in lines] == list(range(1, ITERS + 1))
    assert all(line["loss scale"] == 1024.0 for line in lines)
    assert all(line["number of skipped iterations"] == 0 for line in lines)


def test_fp16_inf_gradient_skips_the_step_and_halves_the_scale(runs):
    run = runs["fp16-inf"]
    assert run["skipped"] == [i == 3 for i in range(ITERS)]
    assert run["scales"] == [1024.0] * 3 + [512.0] * (ITERS - 3)  # --hysteresis 1
    # The skipped step left the weights as they were; the others moved them (but the first:
    # warm-up starts the learning rate at 0, as in Megatron).
    sums = run["checksums"]
    assert len(sums) == ITERS
    assert sums[4] == sums[3]
    assert all(sums[i + 1] != sums[i] for i in range(1, ITERS - 1) if i != 3)
    lines = run["log_lines"]
    line = lines[3]
    assert line["iteration"] == 4
    assert line["number of skipped iterations"] == 1 and line["loss scale"] == 512.0
    assert "grad norm" not in line and "lm loss" not in line  # nothing to report
    assert "number of skipped iterations:   1" in run["log"]
    assert lines[3]["learning rate"] == lines[2]["learning rate"]  # schedule did not step
    assert lines[4]["learning rate"] != lines[3]["learning rate"]
    assert all(line["number of skipped iterations"] == 0 for i, line in enumerate(lines)
               if i != 3)
    assert all(math.isfinite(x) for x in run["losses"][4:])
    assert run["losses"][-1] < run["losses"][0] - 0.1


def _dp2_inf_on_one_rank(rank, world_size, corpus, cache):
    # --hysteresis 2: the first overflow only spends the hysteresis, the second halves.
    argv = base_argv(corpus, cache, **FP16, **{"--hysteresis": 2})
    probe = Probe(1, poison_iterations=(3, 6) if rank == 1 else ())
    return _run(argv, probe)


def test_fp16_inf_on_one_data_parallel_rank_skips_on_both(corpus, tmp_path):
    results = run_distributed(_dp2_inf_on_one_rank, 2, corpus, str(tmp_path))
    for run in results:
        assert run["skipped"] == [i in (2, 5) for i in range(ITERS)]
        assert run["scales"] == [1024.0] * 5 + [512.0] * (ITERS - 5)
    assert results[0]["checksums"] == results[1]["checksums"]  # replicas stay identical
    lines = results[0]["log_lines"]  # rank 0 logs; the inf was on rank 1
    assert [line["number of skipped iterations"] for line in lines] == \
        [float(i in (2, 5)) for i in range(ITERS)]
    assert lines[2]["loss scale"] == 1024.0 and lines[5]["loss scale"] == 512.0
