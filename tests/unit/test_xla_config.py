"""The XLA device without torch_xla (issue 26): the device decision, the flags an XLA run
refuses (naming them) and the XLA-only flags refused elsewhere, the replicas' environment,
and the device-decided optimizer step that a traced XLA step uses, checked on the CPU against
the host-decided one. The runs on a real XLA device are in tests/xla (CI's torch 2.9 env)."""

from __future__ import annotations

import pytest
import torch

from megatron import device as device_mod
from megatron import training_xla, xla
from megatron.config import ConfigError, parse_args
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32, grad_norm_on_device
from megatron.training import pretrain
from run_pretrain_xla import xla_argv

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 1 --train-iters 2 --lr 1e-3 "
        "--mock-data").split()


@pytest.fixture
def torch_xla_installed(monkeypatch):
    """``installed(True/False)``: whether megatron.xla finds torch_xla."""
    def installed(present: bool) -> None:
        monkeypatch.setattr(xla, "torch_xla_importable", lambda: present)
    return installed


def test_pjrt_device_picks_xla_only_where_torch_xla_is_installed(monkeypatch,
                                                                  torch_xla_installed):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    torch_xla_installed(False)
    assert device_mod.compute_device_type(False) in ("cpu", "cuda")
    torch_xla_installed(True)
    assert device_mod.compute_device_type(False) == "xla"
    assert device_mod.resolve_backend("auto", False) == "xla"
    assert device_mod.compute_device_type(True) == "cpu"  # --use-cpu wins over PJRT_DEVICE
    # The generation tools stay off XLA: a GPU where there is one, else the CPU.
    assert device_mod.compute_device_type(False, xla_allowed=False) in ("cpu", "cuda")
    assert device_mod.resolve_backend("auto", False, xla_allowed=False) in ("gloo", "nccl")
    monkeypatch.delenv("PJRT_DEVICE")
    assert device_mod.compute_device_type(False, "xla") == "xla"


def test_device_flag_errors_name_the_flags(torch_xla_installed):
    torch_xla_installed(False)
    with pytest.raises(ConfigError, match="--device xla needs torch_xla"):
        parse_args(TINY + ["--device", "xla"])
    torch_xla_installed(True)
    with pytest.raises(ConfigError, match="--distributed-backend gloo cannot carry XLA"):
        parse_args(TINY + ["--device", "xla", "--distributed-backend", "gloo"])
    with pytest.raises(ConfigError, match="--device xla and --use-cpu"):
        parse_args(TINY + ["--device", "xla", "--use-cpu"])
    with pytest.raises(ConfigError, match="--distributed-backend xla needs an XLA device"):
        parse_args(TINY + ["--distributed-backend", "xla"])
    assert parse_args(TINY + ["--device", "xla"]).training.distributed_backend == "xla"


@pytest.mark.parametrize("flags,world,named", [
    (["--tensor-model-parallel-size", "2"], 2, "--tensor-model-parallel-size"),
    (["--pipeline-model-parallel-size", "2"], 2, "--pipeline-model-parallel-size"),
    (["--fp16"], 1, "--fp16"),
    (["--use-distributed-optimizer"], 2, "--use-distributed-optimizer"),
    (["--overlap-grad-reduce"], 2, "--overlap-grad-reduce"),
    (["--compile"], 1, "--compile"),
    (["--bf16", "--loss-scale", "1024"], 1, "--loss-scale"),
    (["--xla-processes", "2"], 2, "--xla-processes 2"),
])
def test_an_xla_run_refuses_what_it_cannot_do(monkeypatch, torch_xla_installed, flags,
                                              world, named):
    torch_xla_installed(True)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    ok = parse_args(TINY + ["--device", "xla", "--use-syncfree-optim"], world_size=world)
    assert training_xla.unsupported_on_xla(ok) is None
    cfg = parse_args(TINY + ["--device", "xla", "--use-syncfree-optim"] + flags,
                     world_size=world)
    problem = training_xla.unsupported_on_xla(cfg)
    assert problem is not None and named in problem


def test_the_nan_check_on_xla_needs_the_syncfree_optimizer(torch_xla_installed):
    torch_xla_installed(True)
    problem = training_xla.unsupported_on_xla(parse_args(TINY + ["--device", "xla"]))
    assert "--use-syncfree-optim" in problem and "--no-check-for-nan-in-loss-and-grad" in problem
    unchecked = parse_args(TINY + ["--device", "xla", "--no-check-for-nan-in-loss-and-grad"])
    assert training_xla.unsupported_on_xla(unchecked) is None


@pytest.mark.parametrize("flag", [["--use-syncfree-optim"], ["--xla-processes", "2"]])
def test_xla_only_flags_without_an_xla_device_stop_the_run(monkeypatch, capsys, flag):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    with pytest.raises(SystemExit) as stop:
        pretrain(None, None, None, argv=TINY + ["--use-cpu"] + flag)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {flag[0]}") and "XLA device" in err[-1]


def test_replica_environment():
    env = xla.replica_environment(4, {"PJRT_DEVICE": "CPU"}, free_port=1234)
    assert env == {xla.REPLICA_ENV: "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "1234", "CPU_NUM_DEVICES": "4"}
    mine = xla.replica_environment(2, {"PJRT_DEVICE": "CUDA", "GPU_NUM_DEVICES": "2",
                                       "MASTER_PORT": "29500"}, free_port=1)
    assert "GPU_NUM_DEVICES" not in mine and mine["MASTER_PORT"] == "29500"
    assert xla.inside_replica({xla.REPLICA_ENV: "1"}) and xla.inside_replica(
        {"TORCHELASTIC_RUN_ID": "x"}) and not xla.inside_replica({})
    every = xla.replica_environment(0, {"PJRT_DEVICE": "TPU"}, free_port=7)
    assert "WORLD_SIZE" not in every and "TPU_NUM_DEVICES" not in every  # the runtime's
    assert xla.threads_would_stand_for_ranks(0, {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"})
    assert xla.threads_would_stand_for_ranks(2, {"PJRT_DEVICE": "CPU"})
    assert not xla.threads_would_stand_for_ranks(1, {"PJRT_DEVICE": "CPU"})
    assert not xla.threads_would_stand_for_ranks(4, {"PJRT_DEVICE": "TPU"})


def test_run_pretrain_xla_asks_for_every_xla_device_unless_told():
    assert xla_argv(["--bf16"]) == ["--device", "xla", "--xla-processes", "0", "--bf16"]
    assert xla_argv(["--xla-processes=2", "--device", "cpu"]) == ["--xla-processes=2",
                                                                  "--device", "cpu"]


class _SkippableSGD(torch.optim.SGD):
    """Stands in for torch_xla's sync-free SGD (``step(found_inf=...)``) on the CPU."""

    def step(self, closure=None, found_inf=None):
        if found_inf is not None and found_inf.item() > 0:
            return None
        return super().step(closure)


def _model_and_optimizer(check: bool, clip: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    cfg = parse_args(TINY + ["--optimizer", "sgd", "--clip-grad", str(clip)]
                     + ([] if check else ["--no-check-for-nan-in-loss-and-grad"])).optimizer
    optimizer = get_megatron_optimizer(cfg, model)
    optimizer.optimizer.__class__ = _SkippableSGD
    return model, optimizer


def _backward(model, scale: float = 1.0) -> None:
    x = torch.linspace(-1, 1, 32).view(4, 8)
    (model(x).pow(2).sum() * scale).backward()


@pytest.mark.parametrize("check", [True, False])
def test_device_decided_step_equals_the_host_decided_one(check):
    (host_model, host), (dev_model, dev) = (_model_and_optimizer(check, 0.05) for _ in "ab")
    for model in (host_model, dev_model):
        _backward(model, scale=100.0)  # a large gradient: clipping acts
    applied, host_norm, _ = host.step()
    skipped, dev_norm = dev.step_on_device()
    assert applied and float(skipped) == 0.0
    assert float(dev_norm) == pytest.approx(host_norm, rel=1e-6)
    for a, b in zip(host_model.parameters(), dev_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_device_decided_step_skips_a_nonfinite_loss_or_gradient():
    model, optimizer = _model_and_optimizer(True, 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    skipped, _ = optimizer.step_on_device(loss_nonfinite=torch.tensor(True))
    assert float(skipped) == 1.0
    _backward(model, scale=float("nan"))
    skipped, norm = optimizer.step_on_device()
    assert float(skipped) == 1.0 and not torch.isfinite(norm).all()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_grad_norm_on_device_is_the_host_norm(norm_type):
    grads = [torch.randn(3000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    on_device = grad_norm_on_device(grads, None, norm_type)
    assert on_device.shape == (1,)
    assert float(on_device) == get_grad_norm_fp32(grads, None, norm_type)
