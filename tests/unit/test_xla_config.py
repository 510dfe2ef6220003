"""The XLA device without torch_xla (issue 26): the device decision, the flags an XLA run
refuses (naming them) and the XLA-only flags refused elsewhere, the replicas' environment,
and the device-decided optimizer step that a traced XLA step uses, checked on the CPU against
the host-decided one. The runs on a real XLA device are in tests/xla (CI's torch 2.9 env)."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32, grad_norm_on_device
from megatron.core.pipeline_parallel import schedules
from megatron.platform import device as device_mod
from megatron.platform import xla
from megatron.training import pretrain, run_devices, xla_step
from pretrain_gpt import loss_func
from run_pretrain_xla import xla_argv

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 1 --train-iters 2 --lr 1e-3 "
        "--mock-data").split()


@pytest.fixture
def torch_xla_installed(monkeypatch):
    """``installed(True/False)``: whether megatron.platform.xla finds torch_xla."""
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
    with pytest.raises(ConfigError, match="--device xla needs torch_xla") as refused:
        parse_args(TINY + ["--device", "xla"])
    # A pair that exists (torch_xla stops at 2.9), not one made from this torch's version.
    assert "pip install torch==2.9.0 torch_xla==2.9.0 (README, 'XLA (TPU)')" in str(refused.value)
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
    (["--ckpt-format", "torch_dist"], 1, "--ckpt-format torch_dist"),
])
def test_an_xla_run_refuses_what_it_cannot_do(monkeypatch, torch_xla_installed, flags,
                                              world, named):
    torch_xla_installed(True)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    ok = parse_args(TINY + ["--device", "xla", "--use-syncfree-optim"], world_size=world)
    assert xla_step.unsupported_on_xla(ok) is None
    cfg = parse_args(TINY + ["--device", "xla", "--use-syncfree-optim"] + flags,
                     world_size=world)
    problem = xla_step.unsupported_on_xla(cfg)
    assert problem is not None and named in problem


def test_the_nan_check_on_xla_picks_the_syncfree_optimizer(torch_xla_installed, capsys):
    torch_xla_installed(True)
    plain = parse_args(TINY + ["--device", "xla"])
    assert plain.optimizer.use_syncfree_optim and xla_step.unsupported_on_xla(plain) is None
    assert capsys.readouterr().out.count("--use-syncfree-optim chosen") == 1
    for flags in (["--use-syncfree-optim"], ["--no-check-for-nan-in-loss-and-grad"]):
        cfg = parse_args(TINY + ["--device", "xla", *flags])  # chosen by the user: no notice
        assert "chosen" not in capsys.readouterr().out
        assert xla_step.unsupported_on_xla(cfg) is None
    assert not cfg.optimizer.use_syncfree_optim  # no check: torch's optimizer
    assert not parse_args(list(TINY)).optimizer.use_syncfree_optim  # off XLA
    # A configuration made in code resolves alike (the check keeps the sync-free optimizer).
    assert plain.replace(optimizer=plain.optimizer.replace(use_syncfree_optim=False)) \
        .optimizer.use_syncfree_optim


@pytest.mark.parametrize("flag", [["--use-syncfree-optim"], ["--xla-processes", "2"],
                                  ["--xla-spmd"]])
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


def test_devices_of_a_process_before_the_runtime_starts(monkeypatch):
    cpu = {"PJRT_DEVICE": "CPU"}
    assert xla.host_runs_a_thread_per_device(cpu)
    # GPUs: a process each through torch_xla's CUDA plugin, threads without it.
    assert not xla.host_runs_a_thread_per_device({"PJRT_DEVICE": "CUDA"})
    assert xla.host_runs_a_thread_per_device({"PJRT_DEVICE": "CUDA",
                                              "XLA_REGISTER_INSTALLED_PLUGINS": "0"})
    for generation, threads in ((3, True), (4, False)):  # a v3-8: 2 cores per chip
        monkeypatch.setattr(xla, "_tpu_version", lambda g=generation: g)
        assert xla.host_runs_a_thread_per_device({"PJRT_DEVICE": "TPU"}) == threads
    assert xla.devices_of_a_process(cpu) == 1
    assert xla.devices_of_a_process({**cpu, "CPU_NUM_DEVICES": "4"}) == 4
    assert xla.devices_of_a_process({"PJRT_DEVICE": "CUDA", "GPU_NUM_DEVICES": "2"}) == 2


def _xla_run(monkeypatch, flags=(), world=1, devices="2"):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", devices)
    for name in (xla.REPLICA_ENV, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return parse_args(TINY + ["--device", "xla", "--use-syncfree-optim", *flags],
                      world_size=world)


def test_spmd_is_the_default_where_one_process_drives_several_devices(monkeypatch,
                                                                      torch_xla_installed):
    torch_xla_installed(True)
    monkeypatch.setattr(xla, "use_spmd", lambda: 2)  # torch_xla's; the runs are in tests/xla
    assert xla_step.spmd_devices(_xla_run(monkeypatch)) == 2
    assert xla_step.spmd_devices(_xla_run(monkeypatch, ["--xla-processes", "0"])) == 2
    assert xla_step.spmd_devices(_xla_run(monkeypatch, ["--xla-spmd"], devices="1")) == 2
    for flags, world, devices in ((["--no-xla-spmd"], 1, "2"), ([], 1, "1"), ([], 2, "2"),
                                  (["--xla-processes", "1"], 1, "2")):
        assert xla_step.spmd_devices(_xla_run(monkeypatch, flags, world, devices)) is None
    # --xla-processes 0 starts no replicas where they would be threads: SPMD trains here.
    assert not xla_step.launches_replicas(_xla_run(monkeypatch, ["--xla-processes", "0"]))
    assert xla_step.launches_replicas(
        _xla_run(monkeypatch, ["--xla-processes", "0", "--no-xla-spmd"]))
    assert xla_step.launches_replicas(_xla_run(monkeypatch, ["--xla-processes", "1"]))
    assert not xla_step.launches_replicas(_xla_run(monkeypatch))
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setattr(xla, "_tpu_version", lambda: 4)  # a process per chip
    tpu = parse_args(TINY + ["--device", "xla", "--xla-processes", "0"])
    assert xla_step.launches_replicas(tpu)
    assert not xla_step.launches_replicas(
        parse_args(TINY + ["--device", "xla", "--xla-processes", "0", "--xla-spmd"]))


@pytest.mark.parametrize("flags,world,named", [
    (["--xla-spmd", "--xla-processes", "1"], 1, "--xla-spmd trains every device"),
    (["--xla-spmd"], 2, "--xla-spmd with 2 processes"),
    (["--xla-processes", "2"], 1, "--xla-processes 2: torch_xla runs the XLA devices"),
])
def test_spmd_refuses_what_it_does_not_do(monkeypatch, torch_xla_installed, flags, world,
                                          named):
    torch_xla_installed(True)
    problem = xla_step.unsupported_on_xla(_xla_run(monkeypatch, flags, world))
    assert problem is not None and named in problem


def test_spmd_batch_arithmetic_is_megatrons_with_a_rank_per_device():
    cfg = parse_args(TINY + ["--micro-batch-size", "2"], xla_spmd_devices=4)
    assert cfg.data_parallel_size == 4 and cfg.training.global_batch_size == 8
    assert cfg.num_microbatches == 1 and run_devices(cfg) == 4
    cfg = parse_args(TINY + ["--global-batch-size", "16"], world_size=2, xla_spmd_devices=2)
    assert cfg.data_parallel_size == 4 and cfg.num_microbatches == 4
    with pytest.raises(ConfigError, match=r"data-parallel size \(2\)"):
        parse_args(TINY + ["--global-batch-size", "3"], xla_spmd_devices=2)


def test_spmd_batch_sizes_the_devices_cannot_split_stop_the_run(monkeypatch, capsys,
                                                                torch_xla_installed):
    torch_xla_installed(True)
    monkeypatch.setattr(xla_step, "spmd_devices", lambda cfg: 2)
    with pytest.raises(SystemExit) as stop:
        pretrain(None, None, None, argv=TINY + ["--device", "xla", "--use-syncfree-optim",
                                                "--global-batch-size", "3"])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: XLA SPMD over 2 devices") and "--global-batch-size (3)" \
        in last, last


def test_the_loss_of_several_devices_micro_batches_is_the_mean_of_their_losses():
    """Under SPMD the XLA engine takes pretrain_gpt's plain loss per device: each device's
    loss is over its own unmasked tokens, as on separate ranks, gradients included."""
    out = torch.arange(24, dtype=torch.float).view(4, 6).requires_grad_()  # devices 0, 1: 2 rows
    mask = torch.ones(4, 6)
    mask[0, :5] = 0  # device 0 counts 7 tokens, device 1 all 12

    def forward_step(data_iterator, model, stage=None):
        return out, functools.partial(loss_func, mask)

    step = xla_step.split_over_devices(forward_step, 2)
    assert schedules.takes_stage(step)  # the schedule still passes the stage
    output, split_loss = step(None, None, stage=None)
    together, reported = split_loss(output)
    apart = [loss_func(mask[r * 2:(r + 1) * 2], out[r * 2:(r + 1) * 2])[0] for r in (0, 1)]
    expected = (apart[0] + apart[1]) / 2
    assert torch.allclose(together, expected)
    assert not torch.allclose(together, loss_func(mask, out)[0])  # the masks differ
    assert torch.equal(reported["lm loss"], together.detach())
    (grad,) = torch.autograd.grad(together, out)
    (want,) = torch.autograd.grad(expected, out)
    assert torch.allclose(grad, want)
    assert xla_step.split_over_devices(forward_step, 1) is forward_step


def test_the_compute_line_says_spmd():
    line = device_mod.describe(torch.device("cpu"), "gloo", False, xla_spmd_devices=2)
    assert "XLA SPMD over 2 device(s)" in line


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
