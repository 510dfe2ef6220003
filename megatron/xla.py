"""XLA devices (TPUs, and GPUs or the CPU under PJRT) through torch_xla: the one module that
imports torch_xla.

A run computes on an XLA device when ``--device xla`` asks for it, or when ``PJRT_DEVICE`` is
set and torch_xla is importable (``megatron.device`` decides). Each replica is a process with
one device: ``torchrun`` with PJRT starts them, or ``--xla-processes N``, which starts them
through ``torch_xla.launch`` (xmp.spawn). The default and model-parallel groups (data
parallel among them) are torch.distributed groups of the ``xla`` backend, so the
data-parallel code is the one every device uses; host values meet in a gloo group
(``parallel_state.get_control_group``). Where one process drives several devices, a
thread each (TPU v2/v3, ``PJRT_DEVICE=CPU`` with ``CPU_NUM_DEVICES`` > 1), the threads would
have to be torch.distributed ranks, which it does not support: such a data-parallel run is
refused (``THREADS_REFUSED``).

An XLA step is traced, not run: nothing reads a device value while it is traced, the step is
cut into one graph by ``mark_step`` once per iteration, and what the log needs reaches the
host in a step closure after the graph ran (``add_step_closure``).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

PJRT_ENV = "PJRT_DEVICE"


def torch_xla_importable() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def requested_by_environment(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether PJRT_DEVICE is set and torch_xla is there to use it."""
    env = os.environ if env is None else env
    return bool(env.get(PJRT_ENV)) and torch_xla_importable()


def _xm():
    import torch_xla.core.xla_model as xm

    return xm


def device() -> torch.device:
    """This process's (or thread's) XLA device."""
    import torch_xla

    return torch_xla.device()


def world() -> tuple[int, int]:
    """(rank, world size) of this replica among all XLA replicas of the run."""
    import torch_xla.runtime as xr

    return xr.global_ordinal(), xr.world_size()


def runs_a_thread_per_device() -> bool:
    """Whether this process drives several devices, one thread each (TPU v2/v3, CPU PJRT)."""
    import torch_xla.runtime as xr

    return xr.addressable_device_count() > 1


THREADS_REFUSED = (
    "data parallelism over the XLA devices of one process (a thread per device: TPU v2/v3, "
    "PJRT_DEVICE=CPU with CPU_NUM_DEVICES > 1) is not supported: torch.distributed keeps one "
    "rank per process. Run one process per device (TPU v4 and later, GPUs under PJRT, with "
    "--xla-processes or torchrun), or a single device")


def threads_would_stand_for_ranks(processes: int, env: Optional[Mapping[str, str]] = None
                                  ) -> bool:
    """Before any runtime exists: whether ``--xla-processes processes`` (0: every device)
    would put several replicas in one process (the CPU client drives all its devices from
    one process)."""
    env = os.environ if env is None else env
    if env.get(PJRT_ENV, "").upper() != "CPU":
        return False
    return processes > 1 or (processes == 0 and int(env.get("CPU_NUM_DEVICES") or 1) > 1)


def init_process_group(timeout_minutes: int) -> Any:
    """Join the run's process groups at torch_xla's rendezvous; returns the host group.

    The default group is torch_xla's ``xla`` backend (its model-parallel subgroups must be
    made from one), which carries XLA tensors only; host values (flags, pickled objects,
    barriers) travel in a gloo group of every rank, returned here for
    ``parallel_state.set_control_group``. (torch_xla's backend is a whole process group, not
    one device's part of a ``cpu:gloo,xla:xla`` group: CPU tensors sent there fail.)"""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the backend

    rank, world_size = world()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group("xla", init_method="xla://", rank=rank, world_size=world_size,
                            timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout)


def mark_step() -> None:
    """End the traced step: the graph is compiled (once per shape) and runs on the device;
    step closures run after it."""
    _xm().mark_step()


def add_step_closure(fn: Callable[..., None], args: tuple = ()) -> None:
    """Run ``fn(*args)`` once the current step's graph has run: device tensors in ``args``
    are read then, outside the traced step."""
    _xm().add_step_closure(fn, args=args)


def compilations() -> int:
    """Graphs compiled by this process so far (torch_xla's CompileTime metric)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def executions() -> int:
    """Graphs run by this process so far (ExecuteTime), once the device is idle: the metric
    is recorded by the thread that ran the graph, a moment after its results are ready."""
    import torch_xla.debug.metrics as met

    _xm().wait_device_ops()

    data = met.metric_data("ExecuteTime")
    return int(data[0]) if data else 0


def syncfree_optimizer(name: str, groups: list[dict], **kwargs: Any) -> torch.optim.Optimizer:
    """torch_xla's sync-free AdamW or SGD (``--use-syncfree-optim``): ``step(found_inf=t)``
    skips the update on the device when ``t`` is non-zero, so no host read decides it."""
    from torch_xla.amp import syncfree

    classes = {"adam": syncfree.AdamW, "sgd": syncfree.SGD}
    if name not in classes:
        raise ValueError(f"--use-syncfree-optim has no sync-free --optimizer {name}")
    optimizer = classes[name](groups, **kwargs)
    optimizer.register_load_state_dict_post_hook(_state_on_the_parameters_device)
    return optimizer


def _state_on_the_parameters_device(optimizer: torch.optim.Optimizer) -> None:
    """After loading: torch keeps a loaded ``step`` on the CPU, where the sync-free kernels
    want every state tensor on its parameter's device; and torch's AdamW (a checkpoint from
    a CPU or GPU run) keeps no ``max_exp_avg_sq`` without amsgrad, where the sync-free AdamW
    keeps an empty one."""
    amsgrad = {p: group.get("amsgrad", False) for group in optimizer.param_groups
               for p in group["params"]}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != param.device:
                state[key] = value.to(param.device)
        if "exp_avg" in state and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = (torch.zeros_like(param) if amsgrad.get(param) else
                                       torch.empty(0, dtype=torch.float, device=param.device))


def to_host(value: Any) -> Any:
    """``value`` with every XLA tensor in it copied to the CPU (dicts, lists, tuples and
    dataclass-free containers), so a checkpoint loads without torch_xla."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type == "xla" else value
    if isinstance(value, dict):
        return type(value)((k, to_host(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_host(v) for v in value)
    return value


def rng_state() -> int:
    return int(_xm().get_rng_state())


def set_rng_state(seed: int) -> None:
    _xm().set_rng_state(int(seed))


# Set by launch_replicas for the replicas it starts (inherited by processes and threads).
REPLICA_ENV = "MEGATRON_XLA_REPLICA"
# The variable that limits how many devices PJRT shows this host, per PJRT_DEVICE.
_NUM_DEVICES_ENV = {"CPU": "CPU_NUM_DEVICES", "CUDA": "GPU_NUM_DEVICES", "GPU": "GPU_NUM_DEVICES",
                    "TPU": "TPU_NUM_DEVICES"}


def inside_replica(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is already one of the run's replicas (started by
    ``launch_replicas``, or by torchrun, which starts one process per device itself)."""
    env = os.environ if env is None else env
    return env.get(REPLICA_ENV) == "1" or "TORCHELASTIC_RUN_ID" in env


class _Replica:
    """Picklable ``entry`` for torch_xla's launcher, which passes the replica's index."""

    def __init__(self, entry: Callable[[], Any]) -> None:
        self.entry = entry

    def __call__(self, index: int) -> None:
        # With every device of the host, the world size is known only to the runtime.
        os.environ.setdefault("WORLD_SIZE", str(world()[1]))
        self.entry()


def replica_environment(processes: int, env: Mapping[str, str], free_port: int) -> dict:
    """The variables ``launch_replicas`` sets for ``processes`` replicas on this host: the
    world size the configuration is checked against, the rendezvous, and PJRT's device count
    (unless the user set it)."""
    chosen = {REPLICA_ENV: "1", "MASTER_ADDR": env.get("MASTER_ADDR") or "127.0.0.1",
              "MASTER_PORT": env.get("MASTER_PORT") or str(free_port)}
    if processes == 0:  # every device: the replicas learn the world size from the runtime
        return chosen
    chosen["WORLD_SIZE"] = str(processes)
    count_env = _NUM_DEVICES_ENV.get(env.get(PJRT_ENV, "").upper())
    if count_env and not env.get(count_env):
        chosen[count_env] = str(processes)
    return chosen


def launch_replicas(entry: Callable[[], Any], processes: int, start_method: str,
                    free_port: int) -> None:
    """``--xla-processes N``: run ``entry()`` once per XLA device of this host through
    ``torch_xla.launch`` (xmp.spawn: a process per chip, a thread per device where one
    process drives several), ``start_method`` being ``--mp-start-method``."""
    import torch_xla

    os.environ.update(replica_environment(processes, os.environ, free_port))
    if processes == 0:
        os.environ.pop("WORLD_SIZE", None)
    try:
        torch_xla.launch(_Replica(entry), args=(), start_method=start_method,
                         debug_single_process=processes == 1)
    except Exception:  # noqa: BLE001 - a replica failed and printed why; no second traceback
        raise SystemExit(1) from None
