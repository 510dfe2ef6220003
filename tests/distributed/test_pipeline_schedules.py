"""Point-to-point communication and the pipeline schedules on real gloo ranks.

One spawn of 4 ranks runs every check (process start-up dominates the cost): the ranks set
up and tear down their model-parallel groups for each layout. Schedules are checked against
a one-process reference: a whole GPTModel on the same micro-batches, whose loss and gradients
each stage's chunks must reproduce (fp32; relative 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig, layer_range
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, activation_shape
from megatron.model.gpt_model import GPTModel
from tests.dist_utils import run_distributed
from tests.unit.test_host_syncs import HostReads

WORLD = 4
SEQ, MBS, HIDDEN, VOCAB, LAYERS = 8, 2, 16, 60, 8


# Point-to-point --------------------------------------------------------------------------------


def _value(stage: int, direction: int, shape) -> torch.Tensor:
    return torch.full(shape, 10.0 * stage + direction)


def check_ring_exchange(batched: bool) -> dict:
    """Every stage sends forward and backward at once, round the ring (the interleaved
    schedule's wrap included); what arrives must come from the right neighbour."""
    shape = (3, 2, 4)
    comm = P2PCommunicator(shape, torch.float32, torch.device("cpu"), batched=batched)
    s, p = comm.stage, comm.num_stages
    from_prev, from_next = comm.exchange(send_next=_value(s, 1, shape),
                                         send_prev=_value(s, 2, shape),
                                         recv_prev=True, recv_next=True)
    return {"from_prev": from_prev[0, 0, 0].item(), "expect_prev": 10.0 * ((s - 1) % p) + 1,
            "from_next": from_next[0, 0, 0].item(), "expect_next": 10.0 * ((s + 1) % p) + 2,
            "prev_requires_grad": from_prev.requires_grad}


def check_named_steps() -> dict:
    comm = P2PCommunicator((2, 1, 2), torch.float32, torch.device("cpu"))
    s = comm.stage
    out = {"recv_forward_none": None, "recv_backward_none": None}
    # Forward wave: each stage receives from the previous one and passes value + 1 on.
    x = comm.recv_forward()
    if comm.is_first_stage:
        out["recv_forward_none"] = x is None
        x = torch.zeros(2, 1, 2)
    comm.send_forward(x.detach() + 1)
    out["forward_value"] = x[0, 0, 0].item()
    # Backward wave from the last stage.
    g = comm.recv_backward()
    if comm.is_last_stage:
        out["recv_backward_none"] = g is None
        g = torch.zeros(2, 1, 2)
    comm.send_backward(g + 1)
    out["backward_value"] = g[0, 0, 0].item()
    out["stage"] = s
    return out


def check_shape_errors() -> str:
    comm = P2PCommunicator((4, 2, 8), torch.float32, torch.device("cpu"))
    try:
        comm.exchange(send_next=torch.zeros(4, 2, 7))
    except ValueError as error:
        return str(error)
    return ""


def check_sequence_parallel_and_bf16() -> dict:
    """tp = 2, pp = 2 under sequence parallelism in bf16: the communicator derived from the
    model sends [s/tp, b, h] in bf16 between the same tensor ranks of adjacent stages."""
    config = model_config(tp=2, sequence_parallel=True, bf16=True)
    chunk = GPTModel(config, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), first_layer=0,
                     num_layers=1)
    comm = schedules.build_communicator(chunk, SEQ, MBS)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    got = None
    if comm.is_first_stage:
        comm.send_forward(torch.full(comm.tensor_shape, 1.0 + tp_rank, dtype=torch.bfloat16))
    else:
        got = comm.recv_forward()
    return {"shape": comm.tensor_shape, "dtype": str(comm.dtype),
            "got": None if got is None else got[0, 0, 0].item(), "tp_rank": tp_rank}


# Schedules against a one-process reference ----------------------------------------------------


def model_config(tp: int = 1, **changes) -> ModelConfig:
    base = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                vocab_size=VOCAB, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                attention_dropout=0.0, tensor_model_parallel_size=tp, seed=7)
    base.update(changes)
    return ModelConfig(**base)


def micro_batches(dp_rank: int, m: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + dp_rank)
    return [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g) for _ in range(m)]


ONE_STAGE = schedules.StageInfo()


def gpt_forward_step(data_iterator, model, stage=ONE_STAGE):
    """pretrain_gpt.forward_step's shape: tokens on the first stage, labels on the last (the
    schedule says which stage this is)."""
    first, last = stage.is_first, stage.is_last
    tokens = labels = None
    if first or last:
        sample = next(data_iterator)
        tokens, labels = sample[:, :-1], sample[:, 1:]
    out = model(tokens, labels=labels if last else None)
    return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})


def reference_run(m: int, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-micro-batch losses of data-parallel rank 0 and the gradient of the mean loss over
    every rank's micro-batches, from the whole model in this process."""
    model = GPTModel(model_config())
    losses = []
    for dp_rank in range(dp):
        for sample in micro_batches(dp_rank, m):
            loss = model(sample[:, :-1], labels=sample[:, 1:]).mean()
            (loss / (m * dp)).backward()
            if dp_rank == 0:
                losses.append(loss.item())
    return losses, {name: p.grad.clone() for name, p in model.named_parameters()}


def _global_name(local: str, first_layer: int) -> str:
    """A stage's parameter name -> the whole model's (layers are numbered per stage)."""
    if local.startswith("encoder.layers."):
        _, _, index, rest = local.split(".", 3)
        return f"encoder.layers.{first_layer + int(index)}.{rest}"
    if local == "word_embeddings.weight":  # the last stage's copy of the tied embedding
        return "embedding.word_embeddings.weight"
    return local


def _shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(tp, dim=param.partition_dim)[parallel_state.get_tensor_model_parallel_rank()]


def check_schedule(tp: int, pp: int, vp: int, m: int, sequence_parallel: bool = False,
                   overlap: bool = False, batched: bool = True) -> dict:
    """Train one iteration with the pipelined schedule; return the worst relative gradient
    error against the reference and the losses."""
    dp = WORLD // (tp * pp)
    ref_losses, ref_grads = reference_run(m, dp)
    parallel_state.initialize_model_parallel(tp, pp, vp if vp > 1 else None)
    try:
        config = model_config(tp, sequence_parallel=sequence_parallel)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        chunks, firsts = [], []
        for c in range(vp):
            if vp > 1:
                parallel_state.set_virtual_pipeline_model_parallel_rank(c)
            first, count = layer_range([LAYERS // pp] * pp, stage, vp if vp > 1 else None, c)
            model = GPTModel(config, pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage(),
                             first_layer=first, num_layers=count)
            chunks.append(DistributedDataParallel(model, overlap_grad_reduce=overlap,
                                                  bucket_size=2000 if overlap else None))
            firsts.append(first)
        comm = None
        if not batched:
            comm = schedules.build_communicator(chunks[0], SEQ, MBS)
            comm.batched = False
        schedule = schedules.get_forward_backward_func()
        sent = []  # the activations this rank's chunks passed on

        def recording_step(data_iterator, model, stage):
            out, loss_func = gpt_forward_step(data_iterator, model, stage)
            if not stage.is_last:
                sent.append(out)
            return out, loss_func

        data = iter(micro_batches(parallel_state.get_data_parallel_rank(), m))
        with HostReads() as reads:  # on a GPU each would stall the queue (test_host_syncs)
            losses = schedule(forward_step_func=recording_step, data_iterator=data,
                              model=chunks if vp > 1 else chunks[0], num_microbatches=m,
                              seq_length=SEQ, micro_batch_size=MBS, communicator=comm)
        finalize_model_grads(chunks)
        worst = 0.0
        for chunk, first in zip(chunks, firsts):
            for name, param in chunk.module.named_parameters():
                expected = _shard(ref_grads[_global_name(name, first)], param)
                err = (param.main_grad - expected).abs().max() / expected.abs().max()
                worst = max(worst, err.item())
        got_losses = [d["lm loss"].item() for d in losses]
        eval_losses = [d["lm loss"].item() for d in schedule(
            forward_step_func=gpt_forward_step,
            data_iterator=iter(micro_batches(parallel_state.get_data_parallel_rank(), m)),
            model=chunks if vp > 1 else chunks[0], num_microbatches=m, seq_length=SEQ,
            micro_batch_size=MBS, forward_only=True)]
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        reports = (last and parallel_state.get_data_parallel_rank() == 0
                   and parallel_state.get_tensor_model_parallel_rank() == 0)
        return {"grad_err": worst, "losses": got_losses, "eval_losses": eval_losses,
                "ref_losses": ref_losses, "last": last, "reports": reports,
                "host_reads": reads.seen,
                "sent_sizes": sorted({t.numel() for t in sent}), "num_sent": len(sent)}
    finally:
        parallel_state.destroy_model_parallel()


SCHEDULE_CASES = {
    "pp4-m1": dict(tp=1, pp=4, vp=1, m=1),
    "pp4-m3": dict(tp=1, pp=4, vp=1, m=3),
    "pp4-m6": dict(tp=1, pp=4, vp=1, m=6),
    "pp2-dp2-m3-overlap": dict(tp=1, pp=2, vp=1, m=3, overlap=True),
    "pp2-tp2-seqpar-m2": dict(tp=2, pp=2, vp=1, m=2, sequence_parallel=True),
    "pp4-unbatched-m5": dict(tp=1, pp=4, vp=1, m=5, batched=False),
    "pp4-vp2-m4": dict(tp=1, pp=4, vp=2, m=4),
    "pp4-vp2-m8-overlap": dict(tp=1, pp=4, vp=2, m=8, overlap=True),
    "pp2-vp2-m4": dict(tp=1, pp=2, vp=2, m=4),
    "pp2-vp4-dp2-m2": dict(tp=1, pp=2, vp=4, m=2),
}


def _all_checks(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    out: dict = {}
    parallel_state.initialize_model_parallel(1, 4)
    out["ring_batched"] = check_ring_exchange(batched=True)
    out["ring_unbatched"] = check_ring_exchange(batched=False)
    out["named"] = check_named_steps()
    out["shape_error"] = check_shape_errors()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)  # pp = 2: previous and next are one rank
    out["ring_pp2_batched"] = check_ring_exchange(batched=True)
    out["ring_pp2_unbatched"] = check_ring_exchange(batched=False)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 2)
    out["seqpar_bf16"] = check_sequence_parallel_and_bf16()
    parallel_state.destroy_model_parallel()
    for name, case in SCHEDULE_CASES.items():
        out[name] = check_schedule(**case)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, WORLD, timeout=240.0)


@pytest.mark.parametrize("key", ["ring_batched", "ring_unbatched", "ring_pp2_batched",
                                 "ring_pp2_unbatched"])
def test_exchange_reaches_the_right_neighbour(results, key):
    for r in results:
        got = r[key]
        assert got["from_prev"] == got["expect_prev"]
        assert got["from_next"] == got["expect_next"]
        assert got["prev_requires_grad"]


def test_named_steps_skip_missing_neighbours(results):
    named = sorted((r["named"] for r in results), key=lambda d: d["stage"])
    assert named[0]["recv_forward_none"] and named[-1]["recv_backward_none"]
    assert [d["forward_value"] for d in named] == [0.0, 1.0, 2.0, 3.0]
    assert [d["backward_value"] for d in named] == [3.0, 2.0, 1.0, 0.0]


def test_wrong_shape_is_a_clear_error(results):
    message = results[0]["shape_error"]
    assert "(4, 2, 7)" in message and "(4, 2, 8)" in message and "--seq-length" in message


def test_sequence_parallel_shape_and_params_dtype(results):
    # Ranks: tp fastest, then pp; stage 1 = ranks 2, 3 receives from ranks 0, 1.
    for r in results:
        assert r["seqpar_bf16"]["shape"] == activation_shape(SEQ, MBS, HIDDEN,
                                                             sequence_parallel=True,
                                                             tensor_model_parallel_size=2)
        assert r["seqpar_bf16"]["shape"] == (SEQ // 2, MBS, HIDDEN)
        assert r["seqpar_bf16"]["dtype"] == "torch.bfloat16"
    assert [r["seqpar_bf16"]["got"] for r in results[2:]] == [1.0, 2.0]


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_schedule_matches_one_process(results, case):
    for r in results:
        assert r[case]["grad_err"] < 1e-5, (case, r[case]["grad_err"])
        assert r[case]["host_reads"] == [], (case, r[case]["host_reads"])
        if not r[case]["last"]:
            assert r[case]["losses"] == r[case]["eval_losses"] == []
    (reporter,) = [r[case] for r in results if r[case]["reports"]]
    assert reporter["losses"] == pytest.approx(reporter["ref_losses"], rel=1e-5)
    # Every activation sent on was freed once sent (one element left), yet the gradients
    # above are right: the backward ran on the graph alone.
    assert sum(r[case]["num_sent"] for r in results) > 0
    for r in results:
        assert r[case]["sent_sizes"] in ([], [1]), (case, r[case]["sent_sizes"])
    assert reporter["eval_losses"] == pytest.approx(reporter["ref_losses"], rel=1e-5)
