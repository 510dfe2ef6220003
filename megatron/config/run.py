"""``RunConfig``: every slice of one run, the values one slice receives from another, and the
rules that involve more than one slice."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron.config.base import flag, require, to_dict
from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.deepspeed import DeepSpeedConfig
from megatron.config.logs import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.optim import OptimizerConfig, SchedulerConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.training import TrainingConfig
from megatron.platform.xla import SYNCFREE_OPTIMIZERS

# The slices, in the order of --help and of the TOML file, with their table names.
SLICE_CLASSES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "deepspeed": DeepSpeedConfig,
}


@dataclass(frozen=True)
class RunConfig:
    """Every slice of one run's configuration, each value owned by one slice.

    Built by ``megatron.config.parse_args`` (flags and TOML). Fields declared ``received``
    are copied here from their owner, so the model's tensor-parallel size is always the
    parallel slice's. The tokenizer's vocabulary size is known only once the tokenizer is
    built: call ``config.with_vocab_size(tokenizer.vocab_size)``.
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

    SLICES = tuple(SLICE_CLASSES)

    def __post_init__(self) -> None:
        self._resolve_virtual_pipeline()
        self._hand_over_received()
        self._pick_syncfree_optimizer_on_xla()
        self._check_pipeline()
        self._resolve_batch_sizes()
        self._check_interleaved_batch_sizes()
        self._check_schedule_units()
        self._check_warmup_fits_decay()
        self._check_eval_only()
        self._check_decentralized()
        self._check_deepspeed()
        self._check_context_parallel()
        self._check_experts()

    def _set(self, slice_name: str, **changes: Any) -> None:
        current = getattr(self, slice_name)
        if any(getattr(current, k) != v for k, v in changes.items()):
            object.__setattr__(self, slice_name, dataclasses.replace(current, **changes))

    def _pick_syncfree_optimizer_on_xla(self) -> None:
        """On an XLA device the NaN/Inf check (on by default) skips a step on the device,
        which takes torch_xla's sync-free optimizer: it is chosen for the check (AdamW, SGD),
        so the plain command trains there (the parser says so once)."""
        o = self.optimizer
        if (self.training.distributed_backend == "xla" and o.check_for_nan_in_loss_and_grad
                and not o.use_syncfree_optim and o.optimizer in SYNCFREE_OPTIMIZERS):
            self._set("optimizer", use_syncfree_optim=True)

    def _resolve_virtual_pipeline(self) -> None:
        vp = self.parallel.check_virtual_pipeline(self.model.num_layers)
        self._set("parallel", virtual_pipeline_model_parallel_size=vp)

    def _hand_over_received(self) -> None:
        """Copy each received field from the slice that owns it."""
        for slice_name in self.SLICES:
            sub = getattr(self, slice_name)
            changes = {}
            for f in dataclasses.fields(sub):
                source = f.metadata.get("received")
                if source is not None:
                    owner, name = source.split(".")
                    changes[f.name] = getattr(getattr(self, owner), name)
            if changes:
                self._set(slice_name, **changes)

    def _check_decentralized(self) -> None:
        """--dp-mode decentralized keeps whole replicas apart: no sharded optimizer state, no
        DeepSpeed engine, no fp16 loss scale (whose skips would differ between replicas)."""
        if self.parallel.dp_mode != "decentralized":
            return
        for on, flag_name in ((self.optimizer.use_distributed_optimizer,
                               "--use-distributed-optimizer"),
                              (self.deepspeed.deepspeed, "--deepspeed"),
                              (self.optimizer.fp16, "--fp16"),
                              (self.checkpoint.ckpt_format == "torch_dist",
                               "--ckpt-format torch_dist")):
            require(not on, f"--dp-mode decentralized cannot be combined with {flag_name} "
                    "(use --dp-mode allreduce, or leave the flag out; --bf16 works)")

    def _check_pipeline(self) -> None:
        stages = self.pipeline_stage_num_layers
        if self.model.recompute_granularity == "full":
            n = self.model.recompute_num_layers
            require(n is not None and 1 <= n <= max(stages),
                    f"--recompute-num-layers ({n}) must be between 1 and the layers per "
                    f"pipeline stage ({max(stages)})")

    def _resolve_batch_sizes(self) -> None:
        t, dp = self.training, self.parallel.data_parallel_size
        per_step = t.micro_batch_size * dp
        if t.global_batch_size is None:
            self._set("training", global_batch_size=per_step)
            t = self.training
        require(t.global_batch_size % per_step == 0,
                f"--global-batch-size ({t.global_batch_size}) is not divisible by "
                f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})")
        if t.rampup_batch_size is not None:
            start, increment, _ = t.rampup_batch_size
            require(start <= t.global_batch_size
                    and (t.global_batch_size - start) % increment == 0,
                    f"--rampup-batch-size: --global-batch-size ({t.global_batch_size}) minus "
                    f"START ({start}) must be a non-negative multiple of INCREMENT ({increment})")
            require(start % per_step == 0 and increment % per_step == 0,
                    f"--rampup-batch-size START ({start}) and INCREMENT ({increment}) must be "
                    f"multiples of --micro-batch-size ({t.micro_batch_size}) x data-parallel "
                    f"size ({dp})")

    def _check_interleaved_batch_sizes(self) -> None:
        """Every global batch size of the run (ramp-up included) must split into a multiple of
        --pipeline-model-parallel-size micro-batches for the interleaved schedule."""
        if self.parallel.virtual_pipeline_model_parallel_size is None:
            return
        t, pp = self.training, self.parallel.pipeline_model_parallel_size
        dp = self.data_parallel_size
        sizes = [t.global_batch_size]
        if t.rampup_batch_size is not None:
            start, increment, _ = t.rampup_batch_size
            sizes = list(range(start, t.global_batch_size, increment)) + sizes
        for gbs in sizes:
            m = gbs // (t.micro_batch_size * dp)
            require(m % pp == 0,
                    "the interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage) "
                    "needs the micro-batches per iteration to be a multiple of "
                    f"--pipeline-model-parallel-size ({pp}): global batch size {gbs} / "
                    f"(--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})) "
                    f"= {m}")

    def _check_schedule_units(self) -> None:
        """A run measured in iterations takes iteration-based schedule flags, and likewise
        samples (Megatron's rule)."""
        for unit, other in (("samples", "iters"), ("iters", "samples")):
            if getattr(self.training, f"train_{unit}") is None:
                continue
            for name in (f"lr_decay_{other}", f"lr_warmup_{other}"):
                value = getattr(self.scheduler, name)
                require(not value, f"{flag(name)} ({value}) cannot be used with "
                        f"--train-{unit}; use {flag(name.replace(other, unit))}")

    def _check_eval_only(self) -> None:
        t = self.training
        if t.eval_only:
            require(self.checkpoint.load is not None,
                    "--eval-only evaluates a checkpoint: give --load")
            require(t.eval_iters > 0, "--eval-only needs --eval-iters > 0")

    def _check_warmup_fits_decay(self) -> None:
        """The warm-up must end before the decay does (in the run's unit; token-based
        schedules are checked by the scheduler, which counts tokens)."""
        t, sc = self.training, self.scheduler
        unit = "iters" if t.train_iters is not None else "samples"
        length = t.train_iters if unit == "iters" else t.train_samples
        if length is None or sc.lr_decay_tokens is not None or sc.lr_warmup_tokens is not None:
            return
        decay_flag = f"lr_decay_{unit}"
        decay = getattr(sc, decay_flag) or length
        decay_text = (f"{flag(decay_flag)} ({decay})" if getattr(sc, decay_flag)
                      else f"--train-{unit} ({decay}; no {flag(decay_flag)} given)")
        if sc.lr_warmup_fraction is not None:
            require(sc.lr_warmup_fraction < 1.0,
                    f"--lr-warmup-fraction ({sc.lr_warmup_fraction}) leaves no decay: it must "
                    f"be below 1")
            return
        warmup = getattr(sc, f"lr_warmup_{unit}")
        require(not warmup or warmup < decay,
                f"{flag('lr_warmup_' + unit)} ({warmup}) must be shorter than the learning-rate "
                f"decay, {decay_text}")

    def _check_deepspeed(self) -> None:
        """What DeepSpeed's engine cannot combine with (the rules that need its JSON file are
        in megatron/integrations/deepspeed/)."""
        if not self.deepspeed.deepspeed:
            return
        p, pp = self.parallel, self.parallel.pipeline_model_parallel_size
        for given, why in (
                (p.num_layers_per_virtual_pipeline_stage, "--num-layers-per-virtual-pipeline-"
                 "stage: DeepSpeed's pipeline engine has no interleaved schedule"),
                (self.optimizer.use_distributed_optimizer, "--use-distributed-optimizer: "
                 "under --deepspeed ZeRO shards the optimizer state; use --zero-stage 1"),
                (p.sequence_parallel, "--sequence-parallel is not wired into DeepSpeed's "
                 "engine; drop it or train without --deepspeed"),
                (self.training.rampup_batch_size, "--rampup-batch-size: DeepSpeed's engine "
                 "keeps one gradient-accumulation count for the whole run"),
                (self.logging.log_bubble, "--log-bubble measures the built-in pipeline "
                 "schedules, not DeepSpeed's"),
                (self.logging.log_params_norm, "--log-params-norm reads our optimizer's "
                 "parameters; DeepSpeed's engine holds its own (sharded by ZeRO-3), which are "
                 "not measured"),
                (self.logging.log_num_zeros_in_grad, "--log-num-zeros-in-grad counts our "
                 "optimizer's gradients; DeepSpeed's engine keeps its own and reports no count"),
                (self.training.compile, "--compile is not wired into DeepSpeed's engine (its "
                 "ZeRO hooks and pipeline module are not traced); drop it or train without "
                 "--deepspeed"),
                (self.checkpoint.ckpt_format == "torch_dist", "--ckpt-format torch_dist: "
                 "DeepSpeed's engine saves its own checkpoint layout"),
                (self.checkpoint.async_save, "--async-save: DeepSpeed's engine writes its own "
                 "checkpoints, synchronously")):
            require(not given, f"{why} (with --deepspeed)")
        require(not (self.deepspeed.no_pipeline_parallel and pp > 1),
                f"--no-pipeline-parallel runs the plain model in DeepSpeed's engine, which has "
                f"no pipeline stages: it needs --pipeline-model-parallel-size 1, got {pp}")
        if self.deepspeed.deepspeed_activation_checkpointing:
            require(self.model.recompute_granularity == "full",
                    "--deepspeed-activation-checkpointing recomputes whole layers: add "
                    "--recompute-granularity full --recompute-method uniform (or "
                    "--checkpoint-activations)")

    def _check_experts(self) -> None:
        """What mixture-of-experts layers do not combine with yet (each named; the plan is in
        README's Experts paragraph)."""
        e = self.model.num_experts
        if e is None:
            return
        p = self.parallel
        for given, why in (
                (p.context_degree > 1, f"{p.context_flag} {p.context_degree}: the load-"
                 "balancing loss is not summed over the ranks of a sequence yet"),
                (self.training.distributed_backend == "xla", "--distributed-backend xla: the "
                 "XLA step has no data-dependent expert routing")):
            require(not given, f"--num-experts ({e}) cannot be combined with {why}")
        if self.deepspeed.deepspeed:
            self._check_deepspeed_moe()

    def _check_deepspeed_moe(self) -> None:
        """Under --deepspeed the experts are DeepSpeed-MoE's (Megatron-DeepSpeed's way):
        the built-in layer's own options have no meaning there, and what DeepSpeed-MoE
        cannot do here is refused."""
        m, ds, e = self.model, self.deepspeed, self.model.num_experts
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
                     "moe_router_score_function", "moe_router_pre_softmax",
                     "moe_router_load_balancing_type", "moe_token_drop_policy",
                     "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size",
                     "moe_grouped_gemm", "moe_token_dispatcher_type",
                     "moe_router_enable_expert_bias"):
            value = getattr(m, name)
            require(value == type(m).__dataclass_fields__[name].default,
                    f"{flag(name)} ({value}) is the built-in MoE layer's; under --deepspeed the "
                    "experts are DeepSpeed-MoE's (--moe-loss-coeff, "
                    "--moe-train-capacity-factor, --disable-moe-token-dropping, ...)")
        zero = ds.zero_stage  # the JSON file's stage is checked where it is read
        for given, why in (
                (m.moe_router_topk > 2, f"--topk {m.moe_router_topk}: DeepSpeed-MoE routes to "
                 "1 or 2 experts"),
                (self.parallel.tensor_model_parallel_size > 1, "--tensor-model-parallel-size "
                 f"{self.parallel.tensor_model_parallel_size}: DeepSpeed-MoE's expert tensor "
                 "parallelism is not wired here"),
                (not ds.no_pipeline_parallel, "DeepSpeed's pipeline engine: add "
                 "--no-pipeline-parallel"),
                (zero == 3, "--zero-stage 3: DeepSpeed-MoE trains under ZeRO 0-2")):
            require(not given, f"--num-experts ({e}) with --deepspeed (DeepSpeed-MoE): {why}")

    def _check_context_parallel(self) -> None:
        """What splitting each sequence over ranks cannot combine with (the model's own rules,
        divisibility and attention dropout, are ModelConfig's)."""
        p = self.parallel
        cp, name = p.context_degree, p.context_flag
        if cp == 1:
            return
        for given, why in (
                (self.data.reset_attention_mask, "--reset-attention-mask: its per-document "
                 "masks are not split across the context-parallel ranks' attention (use "
                 "--reset-position-ids and --eod-mask-loss alone)"),
                (self.training.distributed_backend == "xla", "--distributed-backend xla: the "
                 "XLA step does not split sequences"),
                (self.deepspeed.deepspeed and not self.deepspeed.no_pipeline_parallel,
                 "--deepspeed without --no-pipeline-parallel: DeepSpeed's pipeline engine "
                 "reduces gradients over its own data-parallel groups, which do not hold the "
                 "context-parallel ranks")):
            require(not given, f"{name} ({cp}) cannot be combined with {why}")

    @property
    def pipeline_stage_num_layers(self) -> tuple[int, ...]:
        """Transformer layers held by each pipeline stage (all virtual chunks together)."""
        return self.parallel.stage_num_layers(self.model.num_layers)

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
        """Nested plain dicts of every field (for checkpoints and logs)."""
        out = {name: to_dict(getattr(self, name)) for name in self.SLICES}
        out["extra"] = dict(self.extra)
        return out

    def settings(self) -> dict:
        """The user-settable values by table: what ``--dump-config`` writes."""
        out = {name: getattr(self, name).settings() for name in self.SLICES}
        if self.extra:
            out["extra"] = dict(self.extra)
        return out
