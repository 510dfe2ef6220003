"""DeepSpeed behind ``--deepspeed``: the one package that imports deepspeed. ``config``
builds and checks DeepSpeed's JSON from our flags; ``engine`` runs DeepSpeed's engine (model,
optimizer, schedule, checkpoints) for the training loop and reads ZeRO's files for the
converter."""

from megatron.integrations.deepspeed.config import (
    DeepSpeedSetupError,
    build_deepspeed_config,
    check_load_folder,
    deepspeed_config_or_exit,
    engine_reads_universal,
)
from megatron.integrations.deepspeed.engine import (
    DeepSpeedRun,
    cpu_comm_op_to_build,
    pickled_classes,
    read_zero_optimizer_file,
    setup_engine,
    zero3_full_weights,
)

__all__ = ["DeepSpeedRun", "DeepSpeedSetupError", "build_deepspeed_config", "check_load_folder",
           "cpu_comm_op_to_build", "deepspeed_config_or_exit", "engine_reads_universal",
           "pickled_classes", "read_zero_optimizer_file", "setup_engine", "zero3_full_weights"]
