"""Configuration: one package owns every value a run is configured with.

- ``base``: how a field is declared (``option`` with its flags and help, ``received`` from
  another slice, ``internal``), ``ConfigError`` and the checks.
- one module per slice: ``model``, ``parallel``, ``optim`` (optimizer and schedule), ``data``
  (with the tokenizer), ``training``, ``checkpoint``, ``logs``, ``deepspeed``.
- ``run``: ``RunConfig``, the slices together, and the rules between them.
- ``cli``: the Megatron-compatible command line generated from the declarations;
  ``compat``: old spellings and accepted no-op flags; ``toml_io``: ``--config`` and
  ``--dump-config``.
"""

from megatron.config.base import ConfigError, flag, to_dict
from megatron.config.checkpoint import CheckpointConfig
from megatron.config.cli import (
    ExtraArgsProvider,
    build_parser,
    flatten_config,
    parse_args,
    parse_args_or_exit,
    print_config,
    unmapped_flags,
)
from megatron.config.compat import NO_OP_FLAGS, TRANSLATED_FLAGS
from megatron.config.data import DEFAULT_SPLIT, DataConfig, canonical_tokenizer_type, parse_blend
from megatron.config.deepspeed import DeepSpeedConfig
from megatron.config.logs import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.optim import OptimizerConfig, SchedulerConfig
from megatron.config.parallel import ParallelConfig, layer_range, split_pipeline_layers
from megatron.config.run import SLICE_CLASSES, RunConfig
from megatron.config.toml_io import config_to_toml, dump_config
from megatron.config.training import TrainingConfig

__all__ = [
    "DEFAULT_SPLIT", "NO_OP_FLAGS", "SLICE_CLASSES", "TRANSLATED_FLAGS", "CheckpointConfig",
    "ConfigError", "DataConfig", "DeepSpeedConfig", "ExtraArgsProvider", "LoggingConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "RunConfig", "SchedulerConfig",
    "TrainingConfig", "build_parser", "canonical_tokenizer_type", "config_to_toml",
    "dump_config", "flag", "flatten_config", "layer_range", "parse_args", "parse_args_or_exit",
    "parse_blend", "print_config", "split_pipeline_layers", "to_dict", "unmapped_flags",
]
