"""Convert a Hugging Face GPT-2 checkpoint (a local folder) to a Megatron checkpoint.

    python tools/convert_hf_gpt2.py --hf-model-dir ./gpt2 --save ./ckpt/gpt2-megatron

writes ``SAVE/release/mp_rank_00/model_optim_rng.pt`` and ``latest_checkpointed_iteration.txt``
(``release``), loadable with ``--load SAVE --finetune`` (model only) at tensor and pipeline
parallel size 1, and prints the model flags that match it. Nothing is downloaded: the folder
must hold ``config.json`` and the weights. Resharding to other layouts is a later tool.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpointing import (  # noqa: E402
    CHECKPOINT_VERSION,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    mp_rank_dir_name,
)
from megatron.config import to_dict  # noqa: E402
from megatron.file_modes import chmod_as_created  # noqa: E402
from megatron.model.hf_gpt2 import hf_to_megatron_state_dict, model_config_from_hf  # noqa: E402


def model_flags(config) -> str:
    """The pretrain_gpt.py flags that build the converted model."""
    flags = [
        f"--num-layers {config.num_layers}", f"--hidden-size {config.hidden_size}",
        f"--num-attention-heads {config.num_attention_heads}",
        f"--ffn-hidden-size {config.ffn_hidden_size}", f"--seq-length {config.seq_length}",
        f"--max-position-embeddings {config.max_position_embeddings}",
        f"--make-vocab-size-divisible-by {config.make_vocab_size_divisible_by}",
        f"--layernorm-epsilon {config.layernorm_epsilon}",
    ]
    if config.activation == "gelu_tanh":
        flags.append("--openai-gelu")
    return " ".join(flags)


def convert(hf_model_dir: str, save_dir: str, make_vocab_size_divisible_by: int = 128) -> str:
    import torch
    from transformers import GPT2LMHeadModel

    if not os.path.isfile(os.path.join(hf_model_dir, "config.json")):
        raise SystemExit(f"error: --hf-model-dir {hf_model_dir!r} has no config.json")
    hf = GPT2LMHeadModel.from_pretrained(hf_model_dir, local_files_only=True)
    config = model_config_from_hf(hf.config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    state = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
        "model": hf_to_megatron_state_dict(hf.state_dict(), config),
        "config": {"model": to_dict(config)},
        "parallel_layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                            "data_parallel_size": 1},
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
    }
    os.makedirs(save_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="release.tmp-", dir=save_dir)
    chmod_as_created(tmp)  # mkdtemp's 0700 would become release/'s mode
    os.makedirs(os.path.join(tmp, mp_rank_dir_name(0, 0, 1)))
    torch.save(state, os.path.join(tmp, mp_rank_dir_name(0, 0, 1), MODEL_FILENAME))
    final = os.path.join(save_dir, "release")
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    tracker_tmp = os.path.join(save_dir, TRACKER_FILENAME + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write("release")
    os.replace(tracker_tmp, os.path.join(save_dir, TRACKER_FILENAME))
    return model_flags(config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-model-dir", required=True, help="local folder of a GPT2LMHeadModel")
    parser.add_argument("--save", required=True, help="Megatron checkpoint folder to write")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    args = parser.parse_args(argv)
    flags = convert(args.hf_model_dir, args.save, args.make_vocab_size_divisible_by)
    print(f"wrote {os.path.join(args.save, 'release')}; train or evaluate it with:\n  {flags} "
          f"--load {args.save} --finetune")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
