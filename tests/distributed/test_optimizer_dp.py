"""Data parallelism and the distributed optimizer against a one-process reference (gloo, CPU).

The reference is plain PyTorch on the whole global batch: ``torch.optim.AdamW`` with
Megatron's two weight-decay groups and ``torch.nn.utils.clip_grad_norm_``. Each spawned run
trains the same small MLP with its share of every global batch and must land on the same
parameters and gradient norms (fp32, 1e-5 relative).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from megatron.config import OptimizerConfig
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import clip_grad_norm_fp32, count_zeros_fp32, get_megatron_optimizer
from tests.dist_utils import run_distributed

GLOBAL_BATCH, STEPS, LR, CLIP, WD = 8, 3, 0.01, 0.5, 0.1
RTOL, ATOL = 1e-5, 1e-7


def packed(fn):
    """Run ``fn`` on spawned ranks, shipping results as bytes.

    run_distributed's torch.multiprocessing queue passes tensors as shared-memory handles that
    vanish when the rank exits, so ranks return ``torch.save`` bytes instead.
    """

    def unpack(blob: bytes):
        return torch.load(io.BytesIO(blob), weights_only=False)

    return lambda world_size, *args: [unpack(b) for b in run_distributed(fn, world_size, *args)]


def _pack(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def build_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 3))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    return x, torch.randn(GLOBAL_BATCH, 3, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def reference_run(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, whole batch: the numbers every layout must reproduce."""
    model = build_model()
    decay = [p for n, p in model.named_parameters() if not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, *global_batch(step)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def build_dp(config: OptimizerConfig, bucket_size=None):
    ddp = DistributedDataParallel(
        build_model(), overlap_grad_reduce=config.overlap_grad_reduce,
        use_distributed_optimizer=config.use_distributed_optimizer, bucket_size=bucket_size)
    return ddp, get_megatron_optimizer(config, [ddp])


def train_steps(ddp, opt, steps, micro_batches: int = 1, first_step: int = 0) -> dict:
    """Train on this rank's share of each global batch; report what the test checks."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    norms, launched_in_backward = [], []
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step)
        per_rank = GLOBAL_BATCH // dp_size
        x, y = x[dp_rank * per_rank:(dp_rank + 1) * per_rank], y[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = i == micro_batches - 1
            if last:
                (loss_fn(ddp, xm, ym) / micro_batches).backward()
            else:
                with ddp.no_sync():
                    (loss_fn(ddp, xm, ym) / micro_batches).backward()
        launched_in_backward.append(sum(b.launched for buf in ddp.buffers for b in buf.buckets))
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    return {"norms": norms, "launched": launched_in_backward,
            "buckets": sum(len(buf.buckets) for buf in ddp.buffers),
            "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()}}


CASES = {
    "allreduce": (dict(), None, 1),
    "overlap": (dict(overlap_grad_reduce=True), 40, 1),
    "grad_accumulation": (dict(overlap_grad_reduce=True), 40, 2),
    "distributed_optimizer": (dict(use_distributed_optimizer=True), None, 1),
    "distributed_optimizer_overlap": (dict(use_distributed_optimizer=True,
                                           overlap_grad_reduce=True), 40, 2),
}


def _dp_cases(names):
    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for name in names:
        flags, bucket_size, micro = CASES[name]
        config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, **flags)
        ddp, opt = build_dp(config, bucket_size)
        out[name] = train_steps(ddp, opt, STEPS, micro)
        out[name]["owned"] = sum(p.numel() for p in opt.get_main_params())
    parallel_state.destroy_model_parallel()
    return out


def _two_rank_suite(rank, world_size):
    """Every 2-rank scenario in one spawn (starting ranks costs more than running them)."""
    out = {"dp": _dp_cases(list(CASES)), "checkpoint": _dp2_save_and_continue()}
    out["tp_clip"] = _tp_clip(rank, max_norm=1.0)
    out["sequence_parallel"] = _sequence_parallel_grads(rank)
    return _pack(out)


def _dp4_suite(rank, world_size):
    out = {"dp": _dp_cases(["distributed_optimizer"])}
    out["pipeline"] = {name: _tied_pipeline(rank, **flags) for name, flags in PIPELINE_CASES.items()}
    return _pack(out)


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.fixture(scope="module")
def two_rank():
    return packed(_two_rank_suite)(2)


@pytest.fixture(scope="module")
def dp2_results(two_rank):
    return [r["dp"] for r in two_rank]


def assert_matches(result, reference):
    ref_norms, ref_params = reference
    assert max(ref_norms) > CLIP, "the reference must exercise clipping"
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms),
                               rtol=RTOL, atol=0.0)
    for name, value in ref_params.items():
        torch.testing.assert_close(result["params"][name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_matches_one_process(case, dp2_results, reference):
    for rank_result in dp2_results:
        assert_matches(rank_result[case], reference)


def test_overlap_launches_buckets_during_backward(dp2_results):
    for case in ("overlap", "grad_accumulation", "distributed_optimizer_overlap"):
        result = dp2_results[0][case]
        assert result["buckets"] > 1
        # Every bucket was already reducing when the last backward returned.
        assert result["launched"] == [result["buckets"]] * STEPS
    assert dp2_results[0]["allreduce"]["launched"] == [0] * STEPS


def test_distributed_optimizer_shards_main_params(dp2_results):
    total = sum(p.numel() for p in build_model().parameters())
    owned = [r["distributed_optimizer"]["owned"] for r in dp2_results]
    assert sum(owned) == total and max(owned) < total
    assert dp2_results[0]["allreduce"]["owned"] == total


@pytest.fixture(scope="module")
def four_rank():
    return packed(_dp4_suite)(4)


def test_distributed_optimizer_dp4(four_rank, reference):
    for r in four_rank:
        assert_matches(r["dp"]["distributed_optimizer"], reference)
    total = sum(p.numel() for p in build_model().parameters())
    assert sum(r["dp"]["distributed_optimizer"]["owned"] for r in four_rank) == total


# Tensor-parallel gradient norm -------------------------------------------------------------


def _full_grads():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 5, generator=g)  # split over 2 tensor ranks along dim 0
    w[0, :3] = 0.0
    b = torch.randn(5, generator=g)
    b[1] = 0.0
    e = torch.randn(4, 5, generator=g)  # the word embedding; its tied copy is marked shared
    return w, b, e


def _tp_clip(rank, max_norm):
    parallel_state.initialize_model_parallel(2, 1)
    w, b, e = _full_grads()
    params = []
    for value, attrs in ((w.chunk(2)[rank], {"tensor_model_parallel": True, "partition_dim": 0}),
                         (b, {}), (e, {}), (e, {"shared": True})):
        p = nn.Parameter(torch.zeros_like(value))
        p.grad = value.clone()
        for k, v in attrs.items():
            setattr(p, k, v)
        params.append(p)
    group = parallel_state.get_model_parallel_group()
    zeros = count_zeros_fp32(params, group)
    norm = clip_grad_norm_fp32(params, max_norm, group)
    parallel_state.destroy_model_parallel()
    return norm, zeros, [p.grad.clone() for p in params]


def test_grad_norm_over_tensor_parallel_layout(two_rank):
    w, b, e = _full_grads()
    expected = torch.cat([w.flatten(), b, e.flatten()]).norm().item()
    assert expected > 1.0, "the layout must exercise clipping"
    for rank, result in enumerate(two_rank):
        norm, zeros, grads = result["tp_clip"]
        assert norm == pytest.approx(expected, rel=1e-6)
        assert zeros == 4  # counted once although b is on both ranks and e twice per rank
        coeff = 1.0 / (expected + 1e-6)
        torch.testing.assert_close(grads[0], w.chunk(2)[rank] * coeff)
        torch.testing.assert_close(grads[1], b * coeff)
        torch.testing.assert_close(grads[2], e * coeff)
        torch.testing.assert_close(grads[3], e * coeff)


# Distributed-optimizer checkpoints ---------------------------------------------------------


def _dp2_save_and_continue():
    parallel_state.initialize_model_parallel(1, 1)
    config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=True)
    ddp, opt = build_dp(config, bucket_size=50)
    train_steps(ddp, opt, STEPS)
    gathered = opt.state_dict()  # collective: every dp rank calls it
    # Like any torch state_dict, it references live state: copy it as a save would.
    sharded = copy.deepcopy(opt.sharded_state_dict())
    model_state = {k: v.clone() for k, v in ddp.state_dict().items()}
    finished = train_steps(ddp, opt, 2, first_step=STEPS)["params"]

    # The same-size path: a fresh model and optimizer restored from this rank's shard.
    ddp2, opt2 = build_dp(config, bucket_size=50)
    ddp2.load_state_dict(model_state)
    opt2.reload_model_params()
    opt2.load_state_dict(sharded)
    resumed = train_steps(ddp2, opt2, 2, first_step=STEPS)["params"]
    parallel_state.destroy_model_parallel()
    return gathered, sharded, model_state, finished, resumed


def test_distributed_optimizer_checkpoint_dp2_to_dp1(two_rank):
    results = [r["checkpoint"] for r in two_rank]
    gathered, sharded, model_state, finished, resumed = results[0]
    for name in finished:
        torch.testing.assert_close(resumed[name], finished[name], rtol=0, atol=0)
    # The gathered state is the same on every data-parallel rank.
    other = results[1][0]["param_state"][0]
    for name, entry in gathered["param_state"][0].items():
        assert set(entry) == {"param", "exp_avg", "exp_avg_sq"}
        for key, value in entry.items():
            torch.testing.assert_close(other[name][key], value, rtol=0, atol=0)

    # dp=1 in this process (no torch.distributed): load the dp=2 checkpoint and continue.
    parallel_state.destroy_model_parallel()
    config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=True)
    ddp, opt = build_dp(config, bucket_size=30)  # another bucket layout on purpose
    ddp.load_state_dict(model_state)
    opt.reload_model_params()
    opt.load_state_dict(gathered)
    params = train_steps(ddp, opt, 2, first_step=STEPS)["params"]
    for name in finished:
        torch.testing.assert_close(params[name], finished[name], rtol=RTOL, atol=ATOL)
    # ... and continuing equals the uninterrupted one-process run too.
    _, ref_params = reference_run(STEPS + 2)
    for name in finished:
        torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=ATOL)

    with pytest.raises(ValueError, match="data-parallel rank 0 of 2"):
        opt.load_state_dict(sharded)


# finalize_model_grads: tied embeddings over pipeline stages, sequence-parallel norms ----------


class TiedStage(nn.Module):
    """A pipeline stage that uses the shared weight ``E`` [5, 3] and a weight of its own."""

    def __init__(self, stage: int):
        super().__init__()
        torch.manual_seed(99)
        self.E = nn.Parameter(torch.randn(5, 3) * 0.5)
        torch.manual_seed(stage)
        # Different sizes per stage, so the two stages lay out their buffers differently.
        self.W = nn.Parameter(torch.randn(3, 2 + 2 * stage) * 0.5)
        if stage == 1:
            self.E.shared = True  # the second copy: the norm must not count it

    def shared_embedding_or_output_weight(self):
        return self.E

    def forward(self, x):
        return x @ self.E @ self.W


def tied_batch(step: int, stage: int):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g)
    ys = torch.randn(GLOBAL_BATCH, 2, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x, ys[stage]


def tied_reference(steps: int = STEPS):
    """One process: both stages share one E; the loss is the sum of the stages' losses."""
    s0, s1 = TiedStage(0), TiedStage(1)
    s1.E = s0.E
    params = {"E": s0.E, "W0": s0.W, "W1": s1.W}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(((s(tied_batch(step, i)[0]) - tied_batch(step, i)[1]) ** 2).mean()
                   for i, s in enumerate((s0, s1)))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params.values(), CLIP)))
        opt.step()
    return norms, {k: v.detach().clone() for k, v in params.items()}


PIPELINE_CASES = {
    "allreduce": dict(),
    "distributed_optimizer_overlap": dict(use_distributed_optimizer=True, overlap_grad_reduce=True),
}


def _tied_pipeline(rank, **flags):
    """pp=2 x dp=2: each stage trains its own loss; E's gradient is summed over stages."""
    parallel_state.initialize_model_parallel(1, 2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, **flags)
    ddp = DistributedDataParallel(TiedStage(stage), bucket_size=4,
                                  overlap_grad_reduce=config.overlap_grad_reduce,
                                  use_distributed_optimizer=config.use_distributed_optimizer)
    opt = get_megatron_optimizer(config, [ddp])
    dp_rank, per_rank = parallel_state.get_data_parallel_rank(), GLOBAL_BATCH // 2
    norms = []
    for step in range(STEPS):
        x, y = tied_batch(step, stage)
        x, y = x[dp_rank * per_rank:(dp_rank + 1) * per_rank], y[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        finalize_model_grads([ddp])
        norms.append(opt.step()[1])
    parallel_state.destroy_model_parallel()
    return stage, norms, ddp.module.E.detach().clone(), ddp.module.W.detach().clone()


@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_tied_embedding_over_pipeline_stages(case, four_rank):
    ref_norms, ref = tied_reference()
    for r in four_rank:
        stage, norms, e, w = r["pipeline"][case]
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=RTOL, atol=0.0)
        torch.testing.assert_close(e, ref["E"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(w, ref[f"W{stage}"], rtol=RTOL, atol=ATOL)


def _sequence_parallel_grads(rank):
    """tp=2: a LayerNorm-like weight saw half the sequence per rank; finalize sums its grad."""
    parallel_state.initialize_model_parallel(2, 1)
    module = nn.Linear(3, 3)
    module.weight.sequence_parallel = True
    ddp = DistributedDataParallel(module)
    module.weight.main_grad.fill_(rank + 1.0)
    module.bias.main_grad.fill_(rank + 1.0)
    finalize_model_grads([ddp])
    parallel_state.destroy_model_parallel()
    return module.weight.main_grad.clone(), module.bias.main_grad.clone()


def test_sequence_parallel_grads_summed_over_tensor_ranks(two_rank):
    for rank, r in enumerate(two_rank):
        weight_grad, bias_grad = r["sequence_parallel"]
        assert torch.equal(weight_grad, torch.full((3, 3), 3.0))
        assert torch.equal(bias_grad, torch.full((3,), rank + 1.0))  # not marked: untouched
