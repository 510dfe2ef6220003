"""The training slice: batch sizes, length of the run, evaluation, exits, devices."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.config.base import (
    ConfigError,
    Slice,
    as_tuples,
    non_negative,
    one_of,
    option,
    optional_positive,
    positive,
    require,
    set_field,
)
from megatron.platform.device import resolve_backend


@dataclass(frozen=True)
class TrainingConfig(Slice):
    """The training loop: batch sizes, length of the run, evaluation, exits, devices."""

    micro_batch_size: int = option(default=1, required=True,
                                   help="Samples per forward/backward pass on each rank.")
    global_batch_size: Optional[int] = option(
        default=None, help="Samples per optimizer step over all ranks (--micro-batch-size x "
        "data-parallel size when unset; the rest is gradient accumulation).")
    rampup_batch_size: Optional[tuple[int, ...]] = option(
        nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
        help="Grow the global batch from START by INCREMENT over SAMPLES samples; off when "
        "unset.")
    train_iters: Optional[int] = option(
        default=None, help="Iterations to train (this or --train-samples is required).")
    train_samples: Optional[int] = option(
        default=None, help="Samples to train (this or --train-iters is required).")
    train_tokens: Optional[int] = option(
        default=None, help="Also stop once this many tokens (samples x --seq-length) are "
        "consumed; no token limit when unset.")
    eval_interval: int = option(default=1000, help="Iterations between evaluations.")
    eval_iters: int = option(default=100, help="Iterations per evaluation (0: none).")
    exit_interval: Optional[int] = option(
        default=None, help="Save and stop at the first iteration divisible by this.")
    exit_duration_in_mins: Optional[int] = option(
        default=None, help="Save and stop after this many minutes of training.")
    exit_signal_handler: bool = option(
        default=False, help="On SIGTERM, save a checkpoint and exit cleanly.")
    max_consecutive_nonfinite_iterations: int = option(
        default=10, help="Stop with exit status 1 once this many iterations in a row had a "
        "NaN/Inf loss or gradient norm (each one skipped), or (fp16) overflowed with a loss "
        "scale that cannot back off further.")
    eval_only: bool = option(
        "--eval-only", "--skip-train", default=False,
        help="Load --load's checkpoint, print its validation and test loss and perplexity "
        "(--eval-iters batches each) and exit: no training, no checkpoint written.")
    seed: int = option(default=1234, help="Seed of weights, dropout and data order.")
    dry_run: bool = option(
        default=False, help="Print the plan of this run (parameters per rank, memory per GPU, "
        "pipeline bubble, FLOPs; as tools/plan.py) and exit before any process group exists; "
        "set WORLD_SIZE to the launch's.")
    # The rehearsal (issue 25): megatron/rehearsal.
    rehearse: bool = option(
        default=False, help="Rehearse this run on this machine instead of training: every "
        "rank of the WORLD_SIZE launch (or one rank of each alike class) runs its set-up and "
        "one training iteration over PyTorch's fake process group; their collectives and "
        "point-to-point operations are matched, and each rank's parameters, memory and "
        "communication volume printed. Exit status 1 when the ranks' communication does not "
        "fit together.")
    rehearse_hidden_size: Optional[int] = option(
        default=None, help="With --rehearse: build the model this wide (a multiple of "
        "--num-attention-heads; the FFN and attention widths shrink in proportion) when the "
        "run's own width does not fit this machine; layers, heads, layout and micro-batches "
        "are kept. The run's own width when unset.")
    rehearse_seq_length: Optional[int] = option(
        default=None, help="With --rehearse: sequences of this many tokens (and as many "
        "positions); the run's --seq-length when unset.")
    rehearse_ranks: str = option(
        default="classes", choices=("classes", "all"), help="With --rehearse: classes runs, "
        "for each pipeline stage, its first rank, and the last rank of the first, a middle and "
        "the last stage as a check that a stage's ranks are alike, and gives every other rank "
        "its stage's first rank's operations in its own groups; all runs every rank.")
    rehearse_full_batch: bool = option(
        default=False, help="With --rehearse and --rampup-batch-size: rehearse an iteration at "
        "the full --global-batch-size instead of the run's first (the ramp-up's START).")
    distributed_backend: str = option(
        default="auto", choices=("auto", "nccl", "gloo", "xla"), help="Collectives library: nccl on "
        "a GPU and gloo on the CPU when auto (the backend follows the device; see --use-cpu).")
    use_cpu: bool = option(
        default=False, help="Train on the CPU (gloo) even where a GPU is visible; otherwise "
        "each process uses the GPU of its LOCAL_RANK whenever CUDA is available.")
    device: str = option(
        default="auto", choices=("auto", "cuda", "cpu", "xla"), help="Where to compute: xla "
        "for TPUs and other XLA devices through torch_xla (also chosen when PJRT_DEVICE is set "
        "and torch_xla is installed); auto picks a GPU where one is visible, else the CPU.")
    xla_processes: Optional[int] = option(
        default=None, help="On an XLA device: start this many replicas through "
        "torch_xla.launch (xmp.spawn), one process per device of this host; 0: one per "
        "device PJRT shows (what run_pretrain_xla.py passes), or, where torch_xla runs the "
        "devices as threads of one process (TPU v2/v3, the CPU under PJRT), all of "
        "them in this process with SPMD (--xla-spmd). Not needed under torchrun.")
    xla_spmd: Optional[bool] = option(
        "--xla-spmd", default=None, action=argparse.BooleanOptionalAction,
        help="On an XLA device: train over every device of this process with torch_xla's "
        "SPMD (the model replicated, each micro-batch split over the devices along its batch "
        "dimension; each device counts as a data-parallel rank). On by default where the "
        "process drives several devices and no launcher started it (TPU v2/v3, "
        "PJRT_DEVICE=CPU with CPU_NUM_DEVICES > 1); --no-xla-spmd trains on the first device "
        "only.")
    mp_start_method: str = option(
        default="spawn", choices=("spawn", "fork", "forkserver"), help="With --xla-processes: "
        "how torch_xla.launch starts the processes (Python multiprocessing's start method).")
    deterministic_mode: bool = option(
        default=False, help="Deterministic kernels only (torch.use_deterministic_algorithms; "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set): a GPU run repeats bit for bit, slower.")
    compile: bool = option(
        default=False, help="torch.compile each transformer layer for training (inductor "
        "fuses the LayerNorms, GeLU, dropout and residual adds around the matmuls); the first "
        "iterations pay for compiling. Generation and evaluation tools stay eager.")
    distributed_timeout_minutes: float = option(
        default=10.0, help="Timeout of every process group's collectives and point-to-point "
        "operations: a rank that waits longer exits (status 1) with one line naming the "
        "group, the operation, the iteration and the ranks that did not arrive (on NCCL, "
        "torch's watchdog reports it). Fractions of a minute are accepted.")
    hang_timeout_minutes: Optional[float] = option(
        default=None, help="Print every thread's Python stack once when a rank makes no "
        "progress (no step, evaluation or checkpoint save finishes) for this many minutes; 0 "
        "turns it off. Unset: half of --distributed-timeout-minutes, so that the stacks come "
        "before the collectives time out.")
    empty_unused_memory_level: int = option(
        default=0, choices=(0, 1, 2), help="1: empty the CUDA allocator's cache after each "
        "step and evaluation; 2: also before the optimizer step (no effect on the CPU).")
    manual_gc: bool = option(
        default=False, help="Turn Python's garbage collector off; collect at set iterations.")
    manual_gc_interval: int = option(
        default=0, help="With --manual-gc: collect every N iterations (0: only around "
        "evaluations).")
    manual_gc_eval: bool = option(
        "--no-manual-gc-eval", default=True, action="store_false",
        help="With --manual-gc: do not collect around evaluations.")

    def __post_init__(self) -> None:
        as_tuples(self, "rampup_batch_size")
        one_of(self, "empty_unused_memory_level", (0, 1, 2))
        non_negative(self, "manual_gc_interval", "eval_iters", "hang_timeout_minutes")
        if self.hang_timeout_minutes is None:
            set_field(self, "hang_timeout_minutes", self.distributed_timeout_minutes / 2)
        positive(self, "micro_batch_size", "eval_interval", "distributed_timeout_minutes",
                 "max_consecutive_nonfinite_iterations")
        optional_positive(self, "global_batch_size", "train_iters", "train_samples",
                          "train_tokens", "exit_interval", "exit_duration_in_mins",
                          "rehearse_hidden_size", "rehearse_seq_length")
        one_of(self, "rehearse_ranks", ("classes", "all"))
        require(self.xla_processes is None or self.xla_processes >= 0,
                f"--xla-processes must be 0 (every device) or positive, got {self.xla_processes}")
        require(self.train_iters is None or self.train_samples is None,
                f"--train-iters ({self.train_iters}) and --train-samples ({self.train_samples}) "
                "are mutually exclusive")
        if self.rampup_batch_size is not None:
            self._check_rampup()
        try:
            backend = resolve_backend(self.distributed_backend, self.use_cpu, self.device)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        set_field(self, "distributed_backend", backend)

    def _check_rampup(self) -> None:
        ramp = self.rampup_batch_size
        require(len(ramp) == 3 and all(isinstance(v, int) for v in ramp),
                f"--rampup-batch-size takes 3 integers START INCREMENT SAMPLES, got {ramp}")
        require(ramp[0] > 0 and ramp[1] > 0 and ramp[2] >= 0,
                "--rampup-batch-size START and INCREMENT must be positive, SAMPLES >= 0, "
                f"got {ramp}")
        require(self.train_iters is None,
                "--rampup-batch-size needs sample-based training (--train-samples), "
                f"not --train-iters ({self.train_iters})")
