"""XLA devices (TPUs, and GPUs or the CPU under PJRT) through torch_xla: the one module that
imports torch_xla.

A run computes on an XLA device when ``--device xla`` asks for it, or when ``PJRT_DEVICE`` is
set and torch_xla is importable (``megatron.platform.device`` decides). Data parallelism over XLA
devices takes one of two forms:

- A process per device (TPU v4 and later, GPUs through torch_xla's CUDA plugin): ``torchrun``
  with PJRT starts them, or
  ``--xla-processes N``, which starts them through ``torch_xla.launch`` (xmp.spawn). The
  default and model-parallel groups (data parallel among them) are torch.distributed groups
  of the ``xla`` backend, so the data-parallel code is the one every device uses; host
  values meet in a gloo group (``parallel_state.get_control_group``).
- One process for every device of the host, where torch_xla would otherwise run a thread
  per device (TPU v2/v3, ``PJRT_DEVICE=CPU`` with ``CPU_NUM_DEVICES`` > 1, GPUs without
  the plugin), which torch.distributed, one rank per process, cannot make
  ranks of: torch_xla's SPMD (``--xla-spmd``, the default there). The model is replicated,
  each micro-batch is split along its batch dimension over a 1-D mesh of the devices
  (``DATA_AXIS``), and XLA's partitioner inserts the gradient all-reduce; the process is the
  run's only torch.distributed rank (gloo, host values only: torch_xla's backend refuses
  SPMD). A thread per device as a torch.distributed rank is refused (``THREADS_REFUSED``).

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


def devices_of_a_process(env: Optional[Mapping[str, str]] = None) -> int:
    """Before any runtime exists (SPMD must be chosen before it starts): the XLA devices a
    process of this host addresses when torch_xla.launch did not start it, as PJRT counts
    them: CPU_NUM_DEVICES; GPU_NUM_DEVICES, else the visible GPUs; the host's TPU cores; 1
    where it cannot be told."""
    env = os.environ if env is None else env
    platform = env.get(PJRT_ENV, "").upper()
    if platform == "CPU":
        return int(env.get("CPU_NUM_DEVICES") or 1)
    if platform in ("CUDA", "GPU"):
        given = env.get("GPU_NUM_DEVICES")
        return int(given) if given else max(torch.cuda.device_count(), 1)
    if platform == "TPU":
        try:
            from torch_xla._internal import tpu

            return max(tpu.num_available_devices(), 1)
        except Exception:  # noqa: BLE001 - no torch_xla, metadata server or known type
            return 1
    return 1


THREADS_REFUSED = (
    "torch_xla runs the XLA devices of this host as threads of one process (TPU v2/v3, "
    "PJRT_DEVICE=CPU with CPU_NUM_DEVICES > 1, GPUs without its device plugin), and "
    "torch.distributed keeps one rank per process: train them in one process with SPMD "
    "instead (--xla-spmd, the default there: leave out --xla-processes, or give 0)")


def host_runs_a_thread_per_device(env: Optional[Mapping[str, str]] = None) -> bool:
    """Before any runtime exists: whether ``torch_xla.launch`` would run this host's devices
    as threads of one process (the CPU; TPU v2/v3; GPUs only where torch_xla's device
    plugins are off, ``XLA_REGISTER_INSTALLED_PLUGINS=0``: its CUDA plugin gives each GPU a
    process) rather than a process each."""
    env = os.environ if env is None else env
    platform = env.get(PJRT_ENV, "").upper()
    if platform == "CPU":
        return True
    if platform in ("CUDA", "GPU"):
        return env.get("XLA_REGISTER_INSTALLED_PLUGINS", "1") != "1"
    return platform == "TPU" and _tpu_version() < 4


def _tpu_version() -> int:
    """The TPU generation (from TPU_ACCELERATOR_TYPE or the VM's metadata, as torch_xla
    reads it); 4 where it cannot be told (a process per chip, torch_xla's default)."""
    try:
        from torch_xla._internal import tpu

        return tpu.version()
    except Exception:  # noqa: BLE001 - no torch_xla, metadata server or known type
        return 4


def use_spmd() -> int:
    """Turn on torch_xla's SPMD for this process; returns the devices the run's mesh spans.
    Only before the runtime starts: turned on later, torch_xla moves the device under
    tensors that exist, which crashed here (segmentation fault)."""
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_runtime_is_initialized():
        raise RuntimeError("XLA SPMD must be turned on before torch_xla's runtime starts")
    xr.use_spmd()
    return xr.global_runtime_device_count()


DATA_AXIS = "data"


def build_data_mesh(devices: int) -> Any:
    """The SPMD devices in a line named ``DATA_AXIS``: micro-batches are split along it,
    everything else (parameters, optimizer state) is replicated."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(devices), (devices,), (DATA_AXIS,))


def to_device_split(batch: torch.Tensor, mesh: Any) -> torch.Tensor:
    """A host micro-batch ``[b, ...]`` on the SPMD device, split along its batch dimension:
    of n devices, device i holds rows ``[i * b / n, (i + 1) * b / n)`` (data-parallel rank
    i's micro-batch). Each device receives its rows only (not the whole batch, then cut)."""
    import torch_xla.distributed.spmd as xs

    spec = xs.ShardingSpec(mesh, (DATA_AXIS,) + (None,) * (batch.dim() - 1))
    return _xm().send_cpu_data_to_device([batch], device(), input_sharding=spec)[0]


def init_process_group(timeout_minutes: int, spmd: bool = False) -> Any:
    """Join the run's process groups; returns the host group (None: the default group).

    The default group is torch_xla's ``xla`` backend (its model-parallel subgroups must be
    made from one), which carries XLA tensors only; host values (flags, pickled objects,
    barriers) travel in a gloo group of every rank, returned here for
    ``parallel_state.set_control_group``. (torch_xla's backend is a whole process group, not
    one device's part of a ``cpu:gloo,xla:xla`` group: CPU tensors sent there fail.) Under
    SPMD the process is the only rank and its default group gloo: the device collectives
    are XLA's (the partitioner's), and torch_xla's backend refuses SPMD."""
    import torch.distributed as dist

    timeout = datetime.timedelta(minutes=timeout_minutes)
    if spmd:
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=timeout)
        return None
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the backend

    rank, world_size = world()
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
    """Graphs run by this process so far (ExecuteTime, or ExecuteReplicatedTime under SPMD),
    once the device is idle: the metric is recorded by the thread that ran the graph, a
    moment after its results are ready."""
    import torch_xla.debug.metrics as met

    _xm().wait_device_ops()
    counts = [met.metric_data(name) for name in ("ExecuteTime", "ExecuteReplicatedTime")]
    return sum(int(data[0]) for data in counts if data)


SYNCFREE_OPTIMIZERS = ("adam", "sgd")  # the --optimizer values torch_xla has sync-free


def syncfree_optimizer(name: str, groups: list[dict], **kwargs: Any) -> torch.optim.Optimizer:
    """torch_xla's sync-free AdamW or SGD (``--use-syncfree-optim``): ``step(found_inf=t)``
    skips the update on the device when ``t`` is non-zero, so no host read decides it."""
    from torch_xla.amp import syncfree

    classes = dict(zip(SYNCFREE_OPTIMIZERS, (syncfree.AdamW, syncfree.SGD)))
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
