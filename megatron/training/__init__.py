"""Training: ``pretrain()`` and what it runs. ``launch`` (flags to last line), ``preflight``
(start-up checks), ``data`` (datasets and iterators), ``engines`` (the step engine: ours, XLA,
DeepSpeed), ``loop`` (the iterations, evaluation, checkpoints, exits), ``meter`` (history,
log line, TensorBoard), ``log`` (the formats), ``state`` (what a run carries),
``xla_step`` (one traced XLA iteration)."""

from megatron.training.engines import StepResult, train_step
from megatron.training.launch import RunCallbacks, pretrain, rank_starter, start_run
from megatron.training.state import TrainState, run_devices

__all__ = ["RunCallbacks", "StepResult", "TrainState", "pretrain", "rank_starter",
           "run_devices", "start_run", "train_step"]
