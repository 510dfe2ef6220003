"""The configuration of a whole run: data, training loop, checkpoints, logging, DeepSpeed, and
the RunConfig that holds every slice (with the model, parallel, optimizer and scheduler slices
of megatron.config) and cross-checks them. megatron/arguments.py fills these from the command
line by field name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from megatron.config import (
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
    _positive,
    _require,
    flag,
    to_dict,
)
from megatron.device import resolve_backend
from megatron.timers import TIMING_LOG_OPTIONS


def canonical_tokenizer_type(name: str) -> str:
    """--tokenizer-type in the tokenizer package's one spelling (forks' aliases accepted)."""
    # Imported here: the tokenizer package is a leaf, but config must import cheaply.
    from megatron.tokenizer.errors import TokenizerConfigError
    from megatron.tokenizer.tokenizer import canonical_tokenizer_type as canonical

    try:
        return canonical(name)
    except TokenizerConfigError as error:
        raise ConfigError(str(error)) from None


def _optional_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value is None or value > 0, f"{flag(name)} must be positive, got {value}")


def _as_tuple(obj: Any, *names: str) -> None:
    """Lists from argparse become tuples, so a frozen config stays immutable."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, list):
            object.__setattr__(obj, name, tuple(value))


Blend = tuple[tuple[str, ...], Optional[tuple[float, ...]]]


def parse_blend(flag_name: str, tokens: Optional[tuple[str, ...]]) -> Optional[Blend]:
    """``--data-path`` tokens -> (prefixes, weights). One prefix has weights None.

    Several datasets are given as ``WEIGHT PREFIX WEIGHT PREFIX ...`` (Megatron's format).
    Weights are returned as given; the blended dataset normalizes them.
    """
    if not tokens:
        return None
    for prefix in tokens[1::2] if len(tokens) > 1 else tokens:
        _require(
            not prefix.endswith((".bin", ".idx")),
            f"{flag_name}: give the dataset prefix without .bin/.idx, got {prefix!r}",
        )
    if len(tokens) == 1:
        return (tokens[0],), None
    _require(
        len(tokens) % 2 == 0,
        f"{flag_name}: expected one prefix or WEIGHT PREFIX pairs, got {len(tokens)} values: "
        f"{' '.join(tokens)}",
    )
    weights = []
    for position, token in enumerate(tokens[0::2]):
        try:
            weight = float(token)
        except ValueError:
            raise ConfigError(
                f"{flag_name}: weight {position + 1} is not a number: {token!r} "
                "(expected WEIGHT PREFIX pairs)"
            ) from None
        _require(
            math.isfinite(weight) and weight >= 0,
            f"{flag_name}: weight {position + 1} must be a non-negative number, got {token}",
        )
        weights.append(weight)
    _require(sum(weights) > 0, f"{flag_name}: the weights sum to zero")
    return tuple(tokens[1::2]), tuple(weights)


def parse_split(split: str) -> tuple[float, float, float]:
    """``--split 969,30,1`` -> train/valid/test fractions summing to 1 (missing parts are 0)."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    _require(1 <= len(parts) <= 3, f"--split takes at most 3 comma-separated numbers, got {split!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split must be comma-separated numbers, got {split!r}") from None
    _require(all(v >= 0 for v in values), f"--split values must be non-negative, got {split!r}")
    _require(sum(values) > 0, f"--split values sum to zero: {split!r}")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return values[0] / total, values[1] / total, values[2] / total


@dataclass(frozen=True)
class DataConfig:
    """Where the training tokens come from, and how they are split and tokenized."""

    data_path: Optional[tuple[str, ...]] = None  # one prefix, or WEIGHT PREFIX pairs
    train_data_path: Optional[tuple[str, ...]] = None  # per-split sources, same format
    valid_data_path: Optional[tuple[str, ...]] = None
    test_data_path: Optional[tuple[str, ...]] = None
    mock_data: bool = False  # synthetic tokens; wins over any path
    split: str = "969,30,1"  # train,valid,test proportions of --data-path
    data_impl: str = "mmap"
    mmap_warmup: bool = False
    data_cache_path: Optional[str] = None  # where index .npy caches go (default: beside data)
    dataloader_type: str = "single"  # or "cyclic"
    num_workers: int = 2
    seq_length: int = 128
    seed: int = 1234

    tokenizer_type: str = "GPT2BPETokenizer"  # or PretrainedFromHF, NullTokenizer (+ aliases)
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_name_or_path: Optional[str] = None  # HuggingFace name or local folder
    vocab_size: Optional[int] = None  # NullTokenizer's size

    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def __post_init__(self) -> None:
        _as_tuple(self, "data_path", "train_data_path", "valid_data_path", "test_data_path")
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            parse_blend(flag(name), getattr(self, name))
        per_split = any(self.blend_per_split)
        _require(
            not (self.data_path and per_split),
            "--data-path and --train-data-path/--valid-data-path/--test-data-path are "
            "mutually exclusive",
        )
        parse_split(self.split)
        object.__setattr__(self, "tokenizer_type", canonical_tokenizer_type(self.tokenizer_type))
        _require(self.data_impl in ("mmap", "infer"), f"--data-impl must be mmap, got {self.data_impl!r}")
        _require(
            self.dataloader_type in ("single", "cyclic"),
            f"--dataloader-type must be single or cyclic, got {self.dataloader_type!r}",
        )
        _require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        _positive(self, "seq_length")
        _optional_positive(self, "vocab_size")

    @property
    def blend(self) -> Optional[Blend]:
        """(prefixes, weights) of --data-path, or None."""
        return parse_blend("--data-path", self.data_path)

    @property
    def blend_per_split(self) -> tuple[Optional[Blend], Optional[Blend], Optional[Blend]]:
        """(train, valid, test) blends of the per-split paths; None where not given."""
        names = ("train_data_path", "valid_data_path", "test_data_path")
        return tuple(parse_blend(flag(n), getattr(self, n)) for n in names)  # type: ignore[return-value]

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        return parse_split(self.split)

    @property
    def has_data_source(self) -> bool:
        return self.mock_data or bool(self.data_path) or any(self.blend_per_split)


@dataclass(frozen=True)
class TrainingConfig:
    """The training loop: batch sizes, length of the run, evaluation, exits, distributed init."""

    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # default micro x data-parallel size (RunConfig)
    rampup_batch_size: Optional[tuple[int, int, int]] = None  # START INCREMENT SAMPLES
    train_iters: Optional[int] = None  # exactly one of train_iters / train_samples (CLI)
    train_samples: Optional[int] = None
    # Megatron-DeepSpeed's cap: training also stops once consumed samples x seq_length
    # reaches it (the schedule length still comes from train_iters / train_samples).
    train_tokens: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100  # 0 skips evaluation
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[int] = None
    exit_signal_handler: bool = False
    seed: int = 1234

    distributed_backend: str = "auto"  # resolved by megatron.device: nccl on a GPU, else gloo
    use_cpu: bool = False  # train on the CPU even where a GPU is visible
    deterministic_mode: bool = False  # deterministic kernels (GPU runs repeat bit for bit)
    distributed_timeout_minutes: int = 10
    use_cpu_initialization: bool = False
    # Uneven pipeline split: layers on the first/last stage; the rest share the middle evenly.
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    # CUDA caching allocator: 1 empties its cache after every step and evaluation, 2 also
    # between forward-backward and the optimizer step (Megatron's levels; no effect on CPU).
    empty_unused_memory_level: int = 0
    # Python's cyclic garbage collector off, run every manual_gc_interval iterations (0:
    # never in training) and around evaluations unless manual_gc_eval is False.
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True

    def __post_init__(self) -> None:
        _require(self.empty_unused_memory_level in (0, 1, 2),
                 f"--empty-unused-memory-level must be 0, 1 or 2, "
                 f"got {self.empty_unused_memory_level}")
        _require(self.manual_gc_interval >= 0,
                 f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}")
        _as_tuple(self, "rampup_batch_size")
        _positive(self, "micro_batch_size", "eval_interval", "distributed_timeout_minutes")
        _optional_positive(
            self, "global_batch_size", "train_iters", "train_samples", "train_tokens",
            "exit_interval", "exit_duration_in_mins", "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
        )
        _require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        _require(
            self.train_iters is None or self.train_samples is None,
            f"--train-iters ({self.train_iters}) and --train-samples ({self.train_samples}) "
            "are mutually exclusive",
        )
        if self.rampup_batch_size is not None:
            self._check_rampup()
        try:
            backend = resolve_backend(self.distributed_backend, self.use_cpu)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        object.__setattr__(self, "distributed_backend", backend)

    def _check_rampup(self) -> None:
        ramp = self.rampup_batch_size
        _require(
            len(ramp) == 3 and all(isinstance(v, int) for v in ramp),
            f"--rampup-batch-size takes 3 integers START INCREMENT SAMPLES, got {ramp}",
        )
        _require(
            ramp[0] > 0 and ramp[1] > 0 and ramp[2] >= 0,
            f"--rampup-batch-size START and INCREMENT must be positive, SAMPLES >= 0, got {ramp}",
        )
        _require(
            self.train_iters is None,
            f"--rampup-batch-size needs sample-based training (--train-samples), "
            f"not --train-iters ({self.train_iters})",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints are saved to and loaded from, and what they hold."""

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_load_lr_state: bool = False  # load the optimizer but restart the LR/WD schedule
    finetune: bool = False  # load weights only, restart at iteration 0
    keep_last_n_checkpoints: Optional[int] = None  # None keeps all
    save_best: bool = False  # also keep the checkpoint with the lowest validation loss
    use_checkpoint_args: bool = False  # model shape from the checkpoint's stored config
    exit_on_missing_checkpoint: bool = False  # --load without a checkpoint is an error
    ckpt_format: str = "torch"  # Megatron-LM's torch format; torch_dist/zarr are not written

    def __post_init__(self) -> None:
        _require(self.ckpt_format == "torch",
                 f"--ckpt-format {self.ckpt_format} is not supported; only torch (the "
                 "iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt layout)")
        _optional_positive(self, "save_interval", "keep_last_n_checkpoints")
        _require(
            self.save is None or self.save_interval is not None,
            f"--save ({self.save}) needs --save-interval",
        )


@dataclass(frozen=True)
class LoggingConfig:
    """What is logged, how often, and where (stdout, TensorBoard)."""

    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    timing_log_level: int = 0  # 0: iteration time only; 1: + main phases; 2: everything
    timing_log_option: str = "minmax"  # across ranks: max, minmax or all (Megatron-LM's)
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_throughput: bool = False
    log_bubble: bool = False  # pipeline bubble time per iteration
    log_loss_scale_to_tensorboard: bool = True
    log_world_size_to_tensorboard: bool = False
    log_all_ranks: bool = False  # every rank prints, lines prefixed "[rank N] "; else rank 0
    wandb_project: Optional[str] = None  # accepted for compatibility; not used

    def __post_init__(self) -> None:
        _positive(self, "log_interval", "tensorboard_log_interval", "tensorboard_queue_size")
        _require(
            self.timing_log_level in (0, 1, 2),
            f"--timing-log-level must be 0, 1 or 2, got {self.timing_log_level}",
        )
        _require(
            self.timing_log_option in TIMING_LOG_OPTIONS,
            f"--timing-log-option must be max, minmax or all, got {self.timing_log_option}",
        )


@dataclass(frozen=True)
class DeepSpeedConfig:
    """DeepSpeed engine switches (flags as in Megatron-DeepSpeed; JSON in --deepspeed_config)."""

    deepspeed: bool = False
    deepspeed_config: Optional[str] = None
    zero_stage: Optional[int] = None  # None: as in the JSON config
    deepspeed_activation_checkpointing: bool = False
    no_pipeline_parallel: bool = False  # DeepSpeed engine without its PipelineModule

    def __post_init__(self) -> None:
        _require(
            self.zero_stage in (None, 0, 1, 2, 3),
            f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}",
        )

    @property
    def ds_pipeline_enabled(self) -> bool:
        return not self.no_pipeline_parallel


def split_pipeline_layers(
    num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None
) -> tuple[int, ...]:
    """Transformer layers on each pipeline stage: even, or with a given first/last stage."""
    if first is None and last is None:
        _require(
            num_layers % pp == 0,
            f"--num-layers ({num_layers}) is not divisible by "
            f"--pipeline-model-parallel-size ({pp})",
        )
        return (num_layers // pp,) * pp
    _require(
        pp > 1,
        "--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers need "
        f"--pipeline-model-parallel-size > 1 (got {pp})",
    )
    given = [n for n in (first, last) if n is not None]
    middle_stages = pp - len(given)
    rest = num_layers - sum(given)
    names = f"--decoder-first-pipeline-num-layers ({first}) and --decoder-last-pipeline-num-layers ({last})"
    if middle_stages == 0:
        _require(rest == 0, f"{names} must add up to --num-layers ({num_layers}) with 2 stages")
        return (first, last)
    _require(
        rest >= middle_stages and rest % middle_stages == 0,
        f"uneven pipeline split: --num-layers ({num_layers}) minus {names} leaves {rest} "
        f"layers, which do not split evenly over the other {middle_stages} stage(s) of "
        f"--pipeline-model-parallel-size ({pp})",
    )
    stages = [rest // middle_stages] * middle_stages
    if first is not None:
        stages.insert(0, first)
    if last is not None:
        stages.append(last)
    return tuple(stages)


@dataclass(frozen=True)
class RunConfig:
    """Every slice of one run's configuration, cross-checked against each other.

    Built by ``megatron.arguments.parse_args``. The tokenizer's vocabulary size is known only
    after the tokenizer is built: call ``config.with_vocab_size(tokenizer.vocab_size)``.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    deepspeed: DeepSpeedConfig = dataclasses.field(default_factory=DeepSpeedConfig)
    extra: dict = dataclasses.field(default_factory=dict)  # flags of an extra_args_provider

    SLICES = ("model", "parallel", "optimizer", "scheduler", "data", "training", "checkpoint",
              "logging", "deepspeed")

    def __post_init__(self) -> None:
        self._check_shared_fields()
        self._check_pipeline()
        self._resolve_batch_sizes()
        self._check_interleaved_batch_sizes()
        self._check_schedule()
        _require(
            not (self.deepspeed.no_pipeline_parallel and self.parallel.pipeline_model_parallel_size > 1),
            "--no-pipeline-parallel needs --pipeline-model-parallel-size 1 "
            f"(got {self.parallel.pipeline_model_parallel_size})",
        )

    def _check_shared_fields(self) -> None:
        """A flag copied into several slices must hold one value everywhere."""
        owners: dict[str, tuple[str, Any]] = {}
        for slice_name in self.SLICES:
            for f in dataclasses.fields(getattr(self, slice_name)):
                if f.name == "vocab_size":
                    continue  # data: the --vocab-size flag; model: the built tokenizer's size
                value = getattr(getattr(self, slice_name), f.name)
                if f.name not in owners:
                    owners[f.name] = (slice_name, value)
                    continue
                first_slice, first_value = owners[f.name]
                _require(
                    value == first_value,
                    f"{flag(f.name)} differs between the {first_slice} config ({first_value}) "
                    f"and the {slice_name} config ({value})",
                )

    def _check_pipeline(self) -> None:
        stages = self.pipeline_stage_num_layers
        vp = self.parallel.virtual_pipeline_model_parallel_size
        if vp is not None and vp > 1:
            pp = self.parallel.pipeline_model_parallel_size
            _require(
                pp > 2,
                "the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs "
                f"--pipeline-model-parallel-size > 2, got {pp}",
            )
            _require(
                all(n % vp == 0 for n in stages),
                f"layers per pipeline stage {stages} are not divisible by the virtual pipeline "
                f"size ({vp})",
            )
        if self.model.recompute_granularity == "full":
            n = self.model.recompute_num_layers
            _require(
                n is not None and 1 <= n <= max(stages),
                f"--recompute-num-layers ({n}) must be between 1 and the layers per pipeline "
                f"stage ({max(stages)})",
            )

    def _resolve_batch_sizes(self) -> None:
        t, dp = self.training, self.parallel.data_parallel_size
        per_step = t.micro_batch_size * dp
        if t.global_batch_size is None:
            object.__setattr__(self, "training", dataclasses.replace(t, global_batch_size=per_step))
            t = self.training
        _require(
            t.global_batch_size % per_step == 0,
            f"--global-batch-size ({t.global_batch_size}) is not divisible by "
            f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})",
        )
        if t.rampup_batch_size is not None:
            start, increment, _ = t.rampup_batch_size
            _require(
                start <= t.global_batch_size and (t.global_batch_size - start) % increment == 0,
                f"--rampup-batch-size: --global-batch-size ({t.global_batch_size}) minus START "
                f"({start}) must be a non-negative multiple of INCREMENT ({increment})",
            )
            _require(
                start % per_step == 0 and increment % per_step == 0,
                f"--rampup-batch-size START ({start}) and INCREMENT ({increment}) must be "
                f"multiples of --micro-batch-size ({t.micro_batch_size}) x data-parallel size "
                f"({dp})",
            )

    def _check_interleaved_batch_sizes(self) -> None:
        """Every global batch size of the run (ramp-up included) must split into a multiple of
        --pipeline-model-parallel-size micro-batches for the interleaved schedule."""
        vp = self.parallel.virtual_pipeline_model_parallel_size
        if vp is None or vp == 1:
            return
        t, pp, dp = self.training, self.parallel.pipeline_model_parallel_size, self.data_parallel_size
        sizes = [t.global_batch_size]
        if t.rampup_batch_size is not None:
            start, increment, _ = t.rampup_batch_size
            sizes = list(range(start, t.global_batch_size, increment)) + sizes
        for gbs in sizes:
            m = gbs // (t.micro_batch_size * dp)
            _require(
                m % pp == 0,
                f"the interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage) "
                f"needs the micro-batches per iteration to be a multiple of "
                f"--pipeline-model-parallel-size ({pp}): global batch size {gbs} / "
                f"(--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})) = {m}")

    def _check_schedule(self) -> None:
        """Iteration-based and sample-based schedules do not mix (Megatron's rule)."""

        def value(name: str) -> Any:
            for slice_name in ("scheduler", "optimizer", "training"):
                if hasattr(getattr(self, slice_name), name):
                    return getattr(getattr(self, slice_name), name)
            return None

        # A run measured in iterations takes iteration-based schedule flags, and likewise samples.
        for unit, other in (("samples", "iters"), ("iters", "samples")):
            if getattr(self.training, f"train_{unit}") is None:
                continue
            for name in (f"lr_decay_{other}", f"lr_warmup_{other}"):
                _require(
                    not value(name),
                    f"{flag(name)} ({value(name)}) cannot be used with --train-{unit}; "
                    f"use {flag(name.replace(other, unit))}",
                )
        if value("lr_warmup_fraction") is not None:
            for name in ("lr_warmup_iters", "lr_warmup_samples"):
                _require(
                    not value(name),
                    f"--lr-warmup-fraction and {flag(name)} ({value(name)}) are mutually exclusive",
                )
        lr, min_lr = value("lr"), value("min_lr")
        if lr is not None and min_lr is not None:
            _require(min_lr <= lr, f"--min-lr ({min_lr}) is larger than --lr ({lr})")

    @property
    def pipeline_stage_num_layers(self) -> tuple[int, ...]:
        """Transformer layers held by each pipeline stage (all virtual chunks together)."""
        return split_pipeline_layers(
            self.model.num_layers,
            self.parallel.pipeline_model_parallel_size,
            self.training.decoder_first_pipeline_num_layers,
            self.training.decoder_last_pipeline_num_layers,
        )

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per iteration at the full global batch size (after any ramp-up)."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.data_parallel_size)

    def with_vocab_size(self, vocab_size: int) -> RunConfig:
        """A copy whose model uses the built tokenizer's vocabulary size (before padding)."""
        return dataclasses.replace(self, model=self.model.replace(vocab_size=vocab_size))

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Nested plain dicts (for checkpoints and logs)."""
        out = {name: to_dict(getattr(self, name)) for name in self.SLICES}
        out["extra"] = dict(self.extra)
        return out
