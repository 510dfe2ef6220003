"""The Megatron log line, TensorBoard scalars, and the lines that say what a load restored and
how a run went. TFLOP/s counts model FLOPs (``megatron.planning.flops``).
"""

from __future__ import annotations

import math
import os
import re
import resource
from collections.abc import Mapping
from typing import Any, Optional

import torch

from megatron.model.moe import DROPPED, EXPERT_LOAD, is_expert_share


def memory_gb() -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def format_memory_report(rank: int, iteration: int) -> Optional[str]:
    """Megatron's memory line for this process's GPU (MB; None on the CPU)::

        [Rank 0] (after 10 iterations) memory (MB) | allocated: ... | max allocated: ...
        | reserved: ... | max reserved: ...

    allocated: tensors alive now; reserved: what the caching allocator holds from the driver
    (what nvidia-smi shows, less the CUDA context); max: peaks since the start.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    mb = 2.0**20
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
            f" | allocated: {torch.cuda.memory_allocated() / mb:.1f}"
            f" | max allocated: {torch.cuda.max_memory_allocated() / mb:.1f}"
            f" | reserved: {torch.cuda.memory_reserved() / mb:.1f}"
            f" | max reserved: {torch.cuda.max_memory_reserved() / mb:.1f}")


def format_log_line(*, iteration: int, train_iters: int, consumed_samples: int,
                    elapsed_ms: float, lr: float, global_batch_size: int,
                    losses: dict[str, float], loss_scale: Optional[float],
                    grad_norm: Optional[float], skipped: int, nan: int, tgs: float,
                    tflops: float, num_zeros: Optional[float] = None,
                    params_norm: Optional[float] = None) -> str:
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    # Each expert's token share goes to TensorBoard and the history, not the line.
    parts += [f"{name}: {value:.6E}" for name, value in losses.items()
              if not is_expert_share(name)]
    if loss_scale is not None:
        parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {num_zeros:.1f}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [
        f"number of skipped iterations: {skipped:3d}",
        f"number of nan iterations: {nan:3d}",
        f"tokens per GPU per second (TGS): {tgs:.1f}",
        f"TFLOP/s per GPU: {tflops:.3f}",
    ]
    return " | ".join(parts) + " |"


_FIELD = re.compile(r"([A-Za-z][A-Za-z_ /()]*?): +([-+0-9.eE]+|nan|inf)")


def parse_log_lines(text: str) -> list[dict]:
    """The fields of each training log line (``format_log_line``) in ``text``: ``iteration``,
    ``train iters`` and every ``name: number`` pair (e.g. ``"learning rate"``, ``"lm loss"``,
    ``"tokens per GPU per second (TGS)"``), in order. Tests and benchmarks read logs with it."""
    lines = []
    for line in text.splitlines():
        m = re.match(r" iteration +(\d+)/ *(\d+) \|", line)
        if not m:
            continue
        fields = {"iteration": int(m.group(1)), "train iters": int(m.group(2))}
        for part in line.split("|")[1:]:
            f = _FIELD.fullmatch(part.strip())
            if f:
                fields[f.group(1)] = float(f.group(2))
        lines.append(fields)
    return lines


def format_eval(prefix: str, losses: dict[str, float]) -> str:
    parts = []
    for name, value in losses.items():
        parts.append(f"{name} value: {value:.6E}")
        parts.append(f"{name} PPL: {math.exp(min(20.0, value)):.6E}")
    line = f" {prefix} | " + " | ".join(parts)
    bar = "-" * len(line)
    return f"{bar}\n{line}\n{bar}"


def format_load_report(report: Any, ckpt: Any, consumed_train_samples: int,
                       evaluating: bool = False) -> str:
    """One line: the folder a load read, its iteration, what it restored and what starts anew
    (and why). ``report`` is checkpointing's LoadReport, ``ckpt`` the CheckpointConfig;
    ``evaluating``: --eval-only, which reads the model alone."""
    model_only = ckpt.finetune or report.release
    whole = "--finetune" if ckpt.finetune else "release checkpoint" if report.release else None
    if evaluating and not model_only:
        whole = "--eval-only"
    restored, reset = ["model"], {}
    parts = [("optimizer state", report.optimizer, whole or "--no-load-optim"),
             ("LR schedule", report.scheduler,
              whole or ("--no-load-optim" if ckpt.no_load_optim else "--no-load-lr-state"
                        if ckpt.no_load_lr_state else "not in the checkpoint")),
             ("RNG state", report.rng,
              whole or ("none stored for this layout, generators start from --seed"
                        if report.rng_from_seed else "--no-load-rng"))]
    for name, loaded, reason in parts:
        if loaded:
            restored.append(name)
        else:
            reset.setdefault(reason, []).append(name)
    if model_only:
        reset[whole].append("iteration to 0")
    where = f"{report.folder}" + (f", {consumed_train_samples} samples consumed"
                                  if not model_only else "")
    line = (f"successfully loaded checkpoint from {os.path.dirname(report.folder)} at iteration "
            f"{report.iteration} ({where}); restored: {', '.join(restored)}")
    for reason, names in reset.items():
        what = "not read" if reason == "--eval-only" else "reset"
        line += f"; {what} ({reason}): {', '.join(names)}"
    return line


def format_run_summary(*, iterations: int, tokens: int, wall_seconds: float,
                       train_seconds: float, world_size: int, flops_per_token: float,
                       train_losses: Mapping[str, float], valid_losses: Mapping[str, float],
                       checkpoint: Optional[str]) -> str:
    """The run's last line: iterations and tokens of this run, wall time (whole process),
    mean TGS and TFLOP/s per GPU over the training loop, the last train and validation
    losses, and the last checkpoint."""
    tgs = tokens / max(train_seconds, 1e-9) / world_size if iterations else 0.0
    parts = [
        f" run summary | iterations: {iterations}",
        f"tokens: {tokens}",
        f"wall time (s): {wall_seconds:.1f}",
        f"mean tokens per GPU per second (TGS): {tgs:.1f}",
        f"mean TFLOP/s per GPU: {tgs * flops_per_token / 1e12:.3f}",
    ]
    parts += [f"last train {name}: {value:.6E}" for name, value in train_losses.items()
              if not is_expert_share(name)]
    parts += [f"last validation {name}: {value:.6E}" for name, value in valid_losses.items()]
    if not train_losses:
        parts.append("last train loss: none")
    if not valid_losses:
        parts.append("last validation loss: none")
    parts.append(f"last checkpoint: {checkpoint}" if checkpoint else "no checkpoint saved")
    return " | ".join(parts) + " |"


ROUTER_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
ROUTING = (EXPERT_LOAD, DROPPED)


def training_series(losses: Mapping[str, float], *, learning_rate: float, batch_size: int,
                    loss_scale: Optional[float], grad_norm: Optional[float],
                    num_zeros: Optional[float], world_size: int, iteration_seconds: float,
                    logging: Any) -> dict[str, Optional[float]]:
    """Megatron-DeepSpeed's TensorBoard tags for a logged iteration (``logging``: the
    LoggingConfig whose switches choose some of them); see TensorBoard.series."""
    # The router losses of mixture-of-experts layers keep Megatron-LM's plain tags.
    series: dict[str, Optional[float]] = {_training_tag(name): value
                                          for name, value in losses.items()}
    series["learning-rate/learning-rate"] = learning_rate
    if logging.log_batch_size_to_tensorboard:
        series["batch-size/batch-size"] = batch_size
    if logging.log_loss_scale_to_tensorboard:
        series["loss-scale/loss-scale"] = loss_scale
    if logging.log_world_size_to_tensorboard:
        series["world-size/world-size"] = world_size
    series["grad-norm/grad-norm"] = grad_norm
    series["num-zeros/num-zeros"] = num_zeros
    if logging.log_timers_to_tensorboard:
        series["iteration-time/iteration-time"] = iteration_seconds
    return series


def _training_tag(name: str) -> str:
    """A reported value's TensorBoard tag: Megatron-LM's plain names for the router losses,
    ``moe/...`` for how the tokens spread over the experts, else Megatron-DeepSpeed's."""
    if name in ROUTER_LOSSES:
        return name
    if name in ROUTING or is_expert_share(name):
        return f"moe/{name}"
    return f"lm-loss-training/{name}"


def evaluation_series(losses: Mapping[str, float], kind: str,
                      with_ppl: bool) -> dict[str, Optional[float]]:
    """Megatron-DeepSpeed's tags for an evaluation (``kind``: validation or test)."""
    series: dict[str, Optional[float]] = {}
    for name, value in losses.items():
        series[f"lm-loss-validation/{name} {kind}"] = value
        if with_ppl:
            series[f"lm-loss-validation/{name} {kind} ppl"] = math.exp(min(20.0, value))
    return series


class WandbOffline:
    """A Weights & Biases run in offline mode (no network: ``wandb sync DIR`` uploads it
    later), on one rank; it receives every scalar TensorBoard writes against the iteration."""

    def __init__(self, logging: Any, save: Optional[str], config: Optional[dict],
                 enabled: bool) -> None:
        self.run = None
        if not (logging.wandb_project and enabled):
            return
        try:
            import wandb
        except ImportError:
            raise ImportError("--wandb-project needs the wandb package: pip install "
                              "'megatron-gpt[wandb]' (or pip install wandb)") from None
        folder = logging.wandb_save_dir or wandb_default_dir(save, logging.tensorboard_dir)
        os.makedirs(folder, exist_ok=True)
        os.environ["WANDB_MODE"] = "offline"  # forced: there may be no route to wandb.ai
        self.run = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name,
                              dir=folder, config=config, mode="offline")

    def log(self, values: Mapping[str, Optional[float]], step: int) -> None:
        if self.run is None:
            return
        finite = {k: float(v) for k, v in values.items()
                  if v is not None and math.isfinite(v)}
        if finite:  # values of one step merge; a later step commits them
            self.run.log(finite, step=step, commit=False)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def wandb_default_dir(save: Optional[str], tensorboard_dir: Optional[str]) -> str:
    """--wandb-save-dir's default: ``--save``/wandb, else ``--tensorboard-dir``/wandb, else
    ./wandb."""
    base = save or tensorboard_dir
    return os.path.join(base, "wandb") if base else os.path.abspath("wandb")


class TensorBoard:
    """A SummaryWriter on one rank; every call is a no-op elsewhere or without a directory.
    ``wandb`` (a ``WandbOffline``) gets the scalars written against the iteration too."""

    def __init__(self, log_dir: Optional[str], enabled: bool, queue_size: int = 1000,
                 wandb: Optional[WandbOffline] = None) -> None:
        self.writer = None
        self.wandb = wandb
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, values: dict[str, Optional[float]], step: int,
                by_iteration: bool = True) -> None:
        """``values`` at ``step``; ``by_iteration`` False: the step counts samples or
        tokens (the 'vs samples/tokens' views; wandb does not get those, its runs plot any
        series against the steps-vs-samples/tokens values logged by iteration)."""
        if by_iteration and self.wandb is not None:
            self.wandb.log(values, step)
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(name, value, step)

    def series(self, values: Mapping[str, Optional[float]], *, iteration: int,
               samples: int, tokens: int) -> None:
        """Megatron-DeepSpeed's three views of each value: ``tag`` by iteration, ``tag vs
        samples`` by consumed samples and ``tag vs tokens`` by consumed tokens."""
        for tag, value in values.items():
            self.scalars({tag: value}, iteration)
            self.scalars({f"{tag} vs samples": value}, samples, by_iteration=False)
            self.scalars({f"{tag} vs tokens": value}, tokens, by_iteration=False)

    def axes(self, *, iteration: int, samples: int, tokens: int) -> None:
        """Megatron-DeepSpeed's tags that map iterations onto samples and tokens and back."""
        self.scalars({"steps-vs-samples/y=steps,x=samples": iteration}, samples,
                     by_iteration=False)
        self.scalars({"steps-vs-tokens/y=steps,x=tokens": iteration}, tokens,
                     by_iteration=False)
        self.scalars({"steps-vs-samples/y=samples,x=steps": samples,
                      "steps-vs-tokens/y=tokens,x=steps": tokens}, iteration)

    def text(self, name: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(name, text, 0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.wandb is not None:
            self.wandb.close()
