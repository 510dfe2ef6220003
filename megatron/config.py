"""Typed, validated configuration: one frozen dataclass per concern.

Field names follow Megatron's flag spellings (``--tensor-model-parallel-size`` becomes
``tensor_model_parallel_size``) so the CLI maps onto them by name. Each dataclass validates its
own fields in ``__post_init__`` and raises ``ConfigError`` naming the flag, before any process
group or tensor is made.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent with another one."""


def flag(field_name: str) -> str:
    """The command-line spelling of a config field: ``hidden_size`` -> ``--hidden-size``."""
    return "--" + field_name.replace("_", "-")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value is not None and value > 0, f"{flag(name)} must be positive, got {value}")


def _probability(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")


def to_dict(config: Any) -> dict:
    """A plain, picklable dict of a config dataclass (dtypes become their names)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[f.name] = value
    return out


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    return _DTYPES[name]


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees. The data-parallel size is derived from the world size."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False

    def __post_init__(self) -> None:
        _positive(self, "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size")
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _require(
            self.world_size % (tp * pp) == 0,
            f"world size ({self.world_size}) is not divisible by --tensor-model-parallel-size "
            f"({tp}) x --pipeline-model-parallel-size ({pp})",
        )
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None:
            _require(vp >= 1, f"virtual pipeline size must be positive, got {vp}")
            _require(
                pp > 1 or vp == 1,
                "--num-layers-per-virtual-pipeline-stage needs "
                f"--pipeline-model-parallel-size > 1 (got {pp})",
            )
        if self.sequence_parallel and tp == 1:
            # Megatron silently turns it off; so do we, by construction of the groups.
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a GPT model (GPT-2 / GPT-3 family)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default 4 x hidden_size
    kv_channels: Optional[int] = None  # default hidden_size // num_attention_heads
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None  # default seq_length
    vocab_size: int = 50257  # the tokenizer's size; padded below
    make_vocab_size_divisible_by: int = 128
    tensor_model_parallel_size: int = 1  # needed for the vocabulary padding

    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    add_bias_linear: bool = True
    activation: str = "gelu"  # "gelu" (tanh approximation off, as GPT-2's exact erf) or "gelu_tanh"

    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    attention_softmax_in_fp32: bool = True
    use_flash_attn: bool = False
    apex_layernorm: bool = True  # use apex's fused LayerNorm when it is installed
    sequence_parallel: bool = False

    recompute_granularity: Optional[str] = None  # None, "full" or "selective"
    recompute_method: Optional[str] = None  # "uniform" or "block" (full recompute only)
    recompute_num_layers: Optional[int] = None

    seed: int = 1234
    perform_initialization: bool = True

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
        _positive(self, "vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size")
        _require(
            self.hidden_size % self.num_attention_heads == 0 or self.kv_channels is not None,
            f"--hidden-size ({self.hidden_size}) is not divisible by "
            f"--num-attention-heads ({self.num_attention_heads})",
        )
        tp = self.tensor_model_parallel_size
        _require(
            self.num_attention_heads % tp == 0,
            f"--num-attention-heads ({self.num_attention_heads}) is not divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _probability(self, "hidden_dropout", "attention_dropout")
        _require(self.init_method_std > 0, f"--init-method-std must be positive, got {self.init_method_std}")
        _require(
            self.position_embedding_type in ("learned_absolute", "rope"),
            f"--position-embedding-type must be learned_absolute or rope, "
            f"got {self.position_embedding_type!r}",
        )
        _require(self.activation in ("gelu", "gelu_tanh"), f"unknown activation {self.activation!r}")
        _require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive")
        _require(
            self.recompute_granularity in (None, "full", "selective"),
            f"--recompute-granularity must be full or selective, got {self.recompute_granularity!r}",
        )
        if self.recompute_granularity == "full":
            _require(
                self.recompute_method in ("uniform", "block"),
                "--recompute-granularity full needs --recompute-method uniform or block, "
                f"got {self.recompute_method!r}",
            )
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        _positive(self, "ffn_hidden_size", "kv_channels")
        _require(
            self.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size ({self.ffn_hidden_size}) is not divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            self.position_embedding_type == "rope"
            or self.max_position_embeddings >= self.seq_length,
            f"--max-position-embeddings ({self.max_position_embeddings}) is smaller than "
            f"--seq-length ({self.seq_length})",
        )
        object.__setattr__(self, "params_dtype", dtype_from_name(self.params_dtype))

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by x tp (Megatron)."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def projection_size(self) -> int:
        """Width of the attention's query/key/value projection: kv_channels x heads."""
        return self.kv_channels * self.num_attention_heads

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


_OPTIMIZERS = ("adam", "sgd")
_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
_WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, mixed precision, loss scaling and gradient reduction (Megatron's flags).

    ``lr`` may stay None for runs that build no optimizer; building one without it raises.
    With ``--bf16``, gradients are accumulated and reduced in fp32, as in Megatron.
    """

    optimizer: str = "adam"  # "adam" (decoupled weight decay, i.e. AdamW) or "sgd"
    lr: Optional[float] = None
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0  # global L2 norm; 0 turns clipping off
    check_for_nan_in_loss_and_grad: bool = True  # skip a step whose loss/grad norm is NaN/Inf
    log_num_zeros_in_grad: bool = False

    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None  # None: dynamic loss scaling (fp16)
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # Not a Megatron flag: stop with an error instead of skipping steps forever.
    max_skips_at_min_loss_scale: int = 100

    accumulate_allreduce_grads_in_fp32: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    ddp_bucket_size: Optional[int] = None  # elements per bucket; None: one bucket per buffer

    def __post_init__(self) -> None:
        _require(self.optimizer in _OPTIMIZERS,
                 f"--optimizer must be one of {', '.join(_OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr is not None:
            _require(self.lr >= 0.0, f"--lr must be non-negative, got {self.lr}")
            _require(self.min_lr <= self.lr,
                     f"--min-lr ({self.min_lr}) is larger than --lr ({self.lr})")
        _require(self.min_lr >= 0.0, f"--min-lr must be non-negative, got {self.min_lr}")
        _require(self.weight_decay >= 0.0,
                 f"--weight-decay must be non-negative, got {self.weight_decay}")
        _probability(self, "adam_beta1", "adam_beta2", "sgd_momentum")
        _positive(self, "adam_eps")
        _require(self.clip_grad >= 0.0, f"--clip-grad must be non-negative, got {self.clip_grad}")
        _require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive")
        if self.loss_scale is not None:
            _positive(self, "loss_scale")
        _positive(self, "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                  "hysteresis", "max_skips_at_min_loss_scale")
        _require(self.min_loss_scale <= self.initial_loss_scale,
                 f"--min-loss-scale ({self.min_loss_scale}) is larger than "
                 f"--initial-loss-scale ({self.initial_loss_scale})")
        if self.ddp_bucket_size is not None:
            _positive(self, "ddp_bucket_size")
        if self.bf16 and not self.accumulate_allreduce_grads_in_fp32:
            # bf16 has too few mantissa bits to sum micro-batch gradients (Megatron does this too).
            object.__setattr__(self, "accumulate_allreduce_grads_in_fp32", True)

    @property
    def params_dtype(self) -> torch.dtype:
        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate warmup/decay and weight-decay increment (Megatron's flags).

    Warmup and decay lengths are in iterations, samples or (Megatron-DeepSpeed) tokens;
    ``megatron.optimizer_param_scheduler.build_optimizer_param_scheduler`` resolves them
    against ``--train-iters`` or ``--train-samples``. ``start/end_weight_decay`` default to
    ``--weight-decay``.
    """

    lr_decay_style: str = "linear"
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_decay_tokens: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_tokens: Optional[int] = None
    lr_warmup_init: float = 0.0
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False

    def __post_init__(self) -> None:
        _require(self.lr_decay_style in _LR_DECAY_STYLES,
                 f"--lr-decay-style must be one of {', '.join(_LR_DECAY_STYLES)}, "
                 f"got {self.lr_decay_style!r}")
        _require(self.weight_decay_incr_style in _WD_INCR_STYLES,
                 f"--weight-decay-incr-style must be one of {', '.join(_WD_INCR_STYLES)}, "
                 f"got {self.weight_decay_incr_style!r}")
        for name in ("lr_decay_iters", "lr_decay_samples", "lr_decay_tokens"):
            if getattr(self, name) is not None:
                _positive(self, name)
        for name in ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init"):
            _require(getattr(self, name) >= 0,
                     f"{flag(name)} must be non-negative, got {getattr(self, name)}")
        if self.lr_warmup_tokens is not None:
            _require(self.lr_warmup_tokens >= 0,
                     f"--lr-warmup-tokens must be non-negative, got {self.lr_warmup_tokens}")
        _require(self.lr_decay_iters is None or self.lr_decay_samples is None,
                 "--lr-decay-iters and --lr-decay-samples are mutually exclusive")
        _require(self.lr_warmup_iters == 0 or self.lr_warmup_samples == 0,
                 "--lr-warmup-iters and --lr-warmup-samples are mutually exclusive")
        if self.lr_warmup_fraction is not None:
            _require(0.0 <= self.lr_warmup_fraction <= 1.0,
                     f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}")
            _require(self.lr_warmup_iters == 0 and self.lr_warmup_samples == 0,
                     "--lr-warmup-fraction cannot be combined with --lr-warmup-iters or "
                     "--lr-warmup-samples")
        for name in ("start_weight_decay", "end_weight_decay"):
            value = getattr(self, name)
            _require(value is None or value >= 0.0,
                     f"{flag(name)} must be non-negative, got {value}")
        _require(not (self.override_opt_param_scheduler
                      and self.use_checkpoint_opt_param_scheduler),
                 "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                 "are mutually exclusive")
