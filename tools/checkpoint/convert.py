#!/usr/bin/env python
"""Convert and reshard GPT checkpoints (Megatron-LM's tools/checkpoint/convert.py interface).

    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver megatron \\
        --load-dir ckpt/tp2pp2 --save-dir ckpt/tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron \\
        --load-dir ./gpt2 --save-dir ckpt/gpt2 --target-tensor-parallel-size 2
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \\
        --load-dir ckpt/gpt2 --save-dir ./gpt2-export [--vocab-file V --merge-file M]

Loaders: ``megatron`` (ours, any tp/pp/virtual layout, with optimizer state; also
Megatron-LM's and our ``--ckpt-format torch_dist`` folders, told by their files; ``core`` is
Megatron-LM's converter's name for that and does the same),
``megatron_deepspeed`` (Megatron-DeepSpeed's ``language_model`` layout, model only), ``hf``
(a local GPT-2, Llama, Mistral, Qwen2, Mixtral or Qwen2-MoE folder), ``deepspeed`` (DeepSpeed engine checkpoints, ``global_stepN/``: plain
model at ZeRO 0-2, ZeRO-3 at tp 1, or the pipeline engine's layer files; model, iteration and
LR schedule, and at ZeRO 1/2 the optimizer state (plain model; the pipeline engine at tp 1);
else train on with --no-load-optim or --finetune), ``universal`` (DeepSpeed's universal
checkpoint, ``ds_to_universal.py``'s folder, or the folder whose ``latest_universal`` names it:
model, fp32 main weights, Adam's moments and step, iteration, and our runs' LR schedule).
Savers: ``megatron`` (ours, at the
target layout; optimizer state goes along, the distributed optimizer's too), ``hf``, and
``core``: Megatron-LM's torch_dist format (``--ckpt-format torch_dist``), the model with its
iteration and sample counters, which Megatron-LM, NeMo and our ``--load`` read at any layout
(no optimizer or RNG state: load it with --no-load-optim --no-load-rng, or --finetune).
The logic lives in ``megatron/conversion/``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.checkpointing import CheckpointError, check_save_dir, save_checkpoint  # noqa: E402
from megatron.checkpointing.formats.deepspeed.engine_folders import load_deepspeed_checkpoint  # noqa: E402
from megatron.checkpointing.formats.deepspeed.universal import read_universal  # noqa: E402
from megatron.checkpointing.formats.deepspeed.universal_folder import find_universal  # noqa: E402
from megatron.config import CheckpointConfig  # noqa: E402
from megatron.conversion import ConversionError, load_full_checkpoint, save_full_checkpoint  # noqa: E402
from megatron.conversion.hf import (  # noqa: E402
    load_hf_checkpoint,
    save_hf_checkpoint,
    save_keeping_tokenizer,
)
from megatron.core import parallel_state  # noqa: E402
from megatron.inference.loading import build_inference_model, run_config_from_stored  # noqa: E402

LOADERS = ("megatron", "core", "hf", "megatron_deepspeed", "deepspeed", "universal")
SAVERS = ("megatron", "hf", "core")



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--model-type", required=True, choices=("GPT",),
                        help="Only GPT models are converted.")
    parser.add_argument("--loader", default="megatron", choices=LOADERS)
    parser.add_argument("--saver", default="megatron", choices=SAVERS)
    parser.add_argument("--load-dir", required=True, help="Checkpoint folder (with its tracker "
                        "file) or HF model folder to read.")
    parser.add_argument("--save-dir", required=True, help="Folder to write.")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="Tensor-parallel size of the saved checkpoint (default: 1).")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="Pipeline-parallel size of the saved checkpoint (default: 1).")
    parser.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        help="Save for the interleaved schedule with this many layers per chunk.")
    parser.add_argument("--target-distributed-optimizer", choices=("yes", "no"), default=None,
                        help="Save the optimizer state for --use-distributed-optimizer or not "
                        "(default: as the source was saved).")
    parser.add_argument("--iteration", type=int, default=None,
                        help="Iteration to read (default: the tracker file's).")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="Unpadded vocabulary of a Megatron-DeepSpeed checkpoint whose "
                        "flags do not record it.")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="--loader hf: pad the vocabulary to a multiple of this x tp.")
    parser.add_argument("--vocab-file", default=None, help="--saver hf: tokenizer vocabulary "
                        "(default: the file the checkpoint recorded).")
    parser.add_argument("--merge-file", default=None, help="--saver hf: BPE merges (default: "
                        "the file the checkpoint recorded).")
    parser.add_argument("--no-checking", action="store_true",
                        help="Do not check the files against the checkpoint's manifest.")
    parser.add_argument("--megatron-path", default=None,
                        help="Accepted for Megatron-LM scripts; not needed here.")
    return parser


def check_args(args: argparse.Namespace) -> None:
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_num_layers_per_virtual_pipeline_stage", "true_vocab_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConversionError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ConversionError("--save-dir must differ from --load-dir")
    if args.saver in ("hf", "core") and ((args.target_tensor_parallel_size or 1) *
                                         (args.target_pipeline_parallel_size or 1) != 1
                                         or args.target_num_layers_per_virtual_pipeline_stage
                                         or args.target_distributed_optimizer is not None):
        what = "one unsharded model" if args.saver == "hf" else \
            "torch_dist, which every layout reads"
        raise ConversionError(f"--saver {args.saver} writes {what}: drop "
                              "--target-tensor-parallel-size/--target-pipeline-parallel-size/"
                              "--target-num-layers-per-virtual-pipeline-stage/"
                              "--target-distributed-optimizer")
    for flag in ("vocab_file", "merge_file"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ConversionError(f"--{flag.replace('_', '-')} {path} does not exist")


def load(args: argparse.Namespace):
    if args.loader == "hf":
        return load_hf_checkpoint(args.load_dir, args.make_vocab_size_divisible_by)
    if args.loader == "universal":
        folder = find_universal(args.load_dir, True, "--load-dir", "--loader universal")
        return read_universal(folder, true_vocab_size=args.true_vocab_size)
    if args.loader == "deepspeed":
        return load_deepspeed_checkpoint(args.load_dir, args.iteration, args.true_vocab_size,
                                         verify=not args.no_checking)
    return load_full_checkpoint(args.load_dir, args.iteration, verify=not args.no_checking,
                                true_vocab_size=args.true_vocab_size)


def save_torch_dist(full, save_dir: str) -> str:
    """``full`` written by this one process as a torch_dist checkpoint under ``save_dir``
    (tensor/pipeline size 1: the format is read at any layout), through the same writer as
    ``pretrain_gpt.py --ckpt-format torch_dist``. Returns the iteration folder."""
    check_save_dir(save_dir)
    cfg = run_config_from_stored(full.config, (1, 1), 1, 1, 1, CheckpointConfig(
        save=save_dir, save_interval=1, ckpt_format="torch_dist", no_save_optim=True,
        no_save_rng=True))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model = build_inference_model(cfg, device=torch.device("cpu"), full_state_dict=full.model)
        return save_checkpoint(full.iteration, [model], None, None, cfg,
                               consumed_train_samples=full.consumed_train_samples,
                               consumed_valid_samples=full.consumed_valid_samples,
                               extra=full.extra)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def save(args: argparse.Namespace, full) -> str:
    if args.saver == "core":
        folder = save_torch_dist(full, args.save_dir)
        return (f"wrote the model (torch_dist, iteration {full.iteration}) to {folder}; "
                f"Megatron-LM reads it with --ckpt-format torch_dist --load {args.save_dir} "
                "--no-load-optim --no-load-rng (or --finetune), as does pretrain_gpt.py")
    if args.saver == "hf":
        files = save_hf_checkpoint(full, args.save_dir, args.vocab_file, args.merge_file)
        return f"wrote {', '.join(files)} to {args.save_dir}"
    distributed = {"yes": True, "no": False, None: None}[args.target_distributed_optimizer]
    tp, pp = args.target_tensor_parallel_size or 1, args.target_pipeline_parallel_size or 1
    # From an HF folder its tokenizer files go along, into SAVE/tokenizer/.
    folder = (save_keeping_tokenizer if args.loader == "hf" else save_full_checkpoint)(
        full, args.save_dir, tp, pp,
        num_layers_per_virtual_pipeline_stage=args.target_num_layers_per_virtual_pipeline_stage,
        use_distributed_optimizer=distributed, source=f"{args.loader}:{args.load_dir}")
    what = "model" if full.optimizer is None else "model and optimizer state"
    how = " --finetune" if full.release else ""
    return (f"wrote {what} at tp={tp}, pp={pp} to {folder}; train from it with "
            f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
            f"--load {args.save_dir}{how}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        full = load(args)
        print(f"read {args.loader} checkpoint {args.load_dir}: iteration {full.iteration}, "
              f"{len(full.model)} tensors, optimizer state "
              f"{'yes' if full.optimizer is not None else 'no'}", flush=True)
        print(save(args, full), flush=True)
    except (ConversionError, CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
