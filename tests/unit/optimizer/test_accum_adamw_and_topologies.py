"""AccumAdamW (issue 15, item 2) against AdamW and a scalar reference; the topologies'
rounds; the flags' checks."""

import math

import pytest
import torch

from megatron.config import ConfigError, OptimizerConfig, ParallelConfig
from megatron.core.distributed.gossip import TopologyError, topology_rounds
from megatron.core.optimizer import build_torch_optimizer
from megatron.core.optimizer.accum_adamw import AccumAdamW


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)),
            torch.nn.Parameter(torch.randn(7, generator=g))]


def _run(optimizer_cls, steps: int, **kwargs) -> list[torch.Tensor]:
    params = _params()
    opt = optimizer_cls(params, lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1,
                        **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params]


def test_accum_steps_1_equals_adamw():
    ours = _run(AccumAdamW, 10, accum_steps=1)
    adamw = _run(torch.optim.AdamW, 10)
    for a, b in zip(ours, adamw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _reference(grads: list[float], p: float, lr=1e-2, b1=0.9, b2=0.98, eps=1e-8, wd=0.1,
               steps=3) -> float:
    """The update of decent-dp's AccumAdamW written out for one scalar."""
    m = v = acc = 0.0
    for t, g in enumerate(grads, start=1):
        p *= 1 - lr * wd
        acc += g / steps
        k = math.ceil(t / steps)
        m_now, v_now = m + (1 - b1) * g, v + (1 - b2) * g * g
        p -= lr / (1 - b1 ** k) * m_now / (math.sqrt(v_now) / math.sqrt(1 - b2 ** k) + eps)
        if t % steps == 0:
            m, v, acc = b1 * (m + (1 - b1) * acc), b2 * (v + (1 - b2) * acc * acc), 0.0
    return p


def test_accumulated_moments_follow_the_reference():
    grads = [0.3, -1.2, 0.7, 2.0, -0.4, 0.1, 0.9]
    p = torch.nn.Parameter(torch.tensor([0.5], dtype=torch.float64))
    opt = AccumAdamW([p], lr=1e-2, accum_steps=3)
    for g in grads:
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    assert p.item() == pytest.approx(_reference(grads, 0.5), rel=1e-12)
    # and the moments really wait: with accum_steps 1 the result differs
    assert _reference(grads, 0.5, steps=1) != pytest.approx(p.item(), rel=1e-6)


def test_accumadamw_from_the_flags():
    config = OptimizerConfig(optimizer="accumadamw", lr=1e-3, accum_steps=4, adam_beta2=0.98,
                             weight_decay=0.1)
    opt = build_torch_optimizer(config, [{"params": _params()}])
    assert isinstance(opt, AccumAdamW)
    assert opt.param_groups[0]["accum_steps"] == 4
    assert opt.param_groups[0]["betas"] == (0.9, 0.98)
    with pytest.raises(ConfigError, match="accum_steps|--accum-steps"):
        OptimizerConfig(optimizer="accumadamw", accum_steps=0)


def _is_partition(rounds, n):
    return all(sorted(r for group in rnd for r in group) == list(range(n)) for rnd in rounds)


def test_topology_rounds():
    assert topology_rounds("complete", 4) == [[[0, 1, 2, 3]]]
    assert topology_rounds("ring", 4) == [[[0, 1], [2, 3]], [[1, 2], [0, 3]]]
    assert topology_rounds("exp", 8) == [
        [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]]]
    aer = topology_rounds("alternating-exp-ring", 8, ranks_per_node=2)
    assert aer == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]],
                   [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1, 4, 5], [2, 3, 6, 7]]]
    for name, n in (("ring", 6), ("exp", 16), ("complete", 3)):
        assert _is_partition(topology_rounds(name, n), n)
    assert topology_rounds("ring", 1) == [[[0]]]
    with pytest.raises(TopologyError, match="even"):
        topology_rounds("ring", 3)
    with pytest.raises(TopologyError, match="power-of-2"):
        topology_rounds("exp", 6)
    with pytest.raises(TopologyError, match="nodes"):
        topology_rounds("alternating-exp-ring", 4, ranks_per_node=4)


def test_dp_flags_are_checked():
    with pytest.raises(ConfigError, match="--dp-topology ring needs an even"):
        ParallelConfig(world_size=3, dp_mode="decentralized", dp_topology="ring")
    with pytest.raises(ConfigError, match="--dp-topology exp needs a power-of-2"):
        ParallelConfig(world_size=6, dp_mode="decentralized", dp_topology="exp")
    ParallelConfig(world_size=3, dp_topology="ring")  # all-reduce mode ignores the topology


@pytest.mark.parametrize("flag", ["--use-distributed-optimizer", "--fp16"])
def test_decentralized_refuses_what_would_mix_replicas(flag):
    from megatron.config import parse_args

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2",
            "--mock-data", "--lr", "1e-3", "--dp-mode", "decentralized"]
    assert parse_args(argv).parallel.dp_mode == "decentralized"
    with pytest.raises(ConfigError, match=f"--dp-mode decentralized cannot be combined with "
                       f"{flag}"):
        parse_args(argv + [flag])


def test_a_topology_the_nodes_cannot_build_stops_before_any_process_group(monkeypatch, capsys):
    from megatron.assembly.build import check_dp_topology_or_exit
    from megatron.config import parse_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one node: no partner node for exp rounds
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2",
            "--mock-data", "--lr", "1e-3", "--dp-mode", "decentralized",
            "--dp-topology", "alternating-exp-ring"]
    cfg = parse_args(argv)
    assert cfg.parallel.data_parallel_size == 4
    with pytest.raises(SystemExit) as stop:
        check_dp_topology_or_exit(cfg)
    assert stop.value.code == 2
    assert "needs a power-of-2 number (at least 2) of nodes" in capsys.readouterr().err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two
    check_dp_topology_or_exit(parse_args(argv))
