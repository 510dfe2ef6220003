"""Pretrain GPT on TPUs and other XLA devices: pretrain_gpt.py on every XLA device of this host.

    PJRT_DEVICE=TPU python run_pretrain_xla.py --mp-start-method spawn --use-syncfree-optim \
        --bf16 <Megatron flags>
    PJRT_DEVICE=CUDA GPU_NUM_DEVICES=2 python run_pretrain_xla.py --use-syncfree-optim ...

The same as ``python pretrain_gpt.py --device xla --xla-processes 0 ...``: every XLA device
of this host, data parallel over them: a replica process per device (torch_xla.launch, the
``xla`` backend) where torch_xla gives each device a process (TPU v4 and later, GPUs through
its CUDA plugin), else SPMD in this process (TPU v2/v3, the CPU; ``--xla-spmd``, see
megatron/platform/xla.py). ``--xla-processes N`` given here takes N devices instead; under torchrun
(one process per device already) it trains in each process as pretrain_gpt.py does.
"""

from __future__ import annotations

import sys

import pretrain_gpt


def xla_argv(argv: list[str]) -> list[str]:
    """``argv`` with the XLA device and every local device asked for, unless it says."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = [] if "--device" in given else ["--device", "xla"]
    extra += [] if "--xla-processes" in given else ["--xla-processes", "0"]
    return extra + argv


if __name__ == "__main__":
    from megatron.checkpointing import CheckpointError

    try:
        pretrain_gpt.main(xla_argv(sys.argv[1:]))
    except CheckpointError as error:  # a damaged or mismatched checkpoint: its message is all
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
