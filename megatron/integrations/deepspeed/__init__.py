"""DeepSpeed behind ``--deepspeed``: ``config`` builds and checks DeepSpeed's JSON from our
flags; ``engine`` runs DeepSpeed's engine (model, optimizer, schedule, checkpoints) for the
training loop. Reading DeepSpeed's checkpoint files (which needs its pickled classes) is the
deepspeed format's (``checkpointing/formats/deepspeed/files.py``); these are the only two
places that import deepspeed."""

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
    setup_engine,
)

__all__ = ["DeepSpeedRun", "DeepSpeedSetupError", "build_deepspeed_config", "check_load_folder",
           "cpu_comm_op_to_build", "deepspeed_config_or_exit", "engine_reads_universal",
           "setup_engine"]
