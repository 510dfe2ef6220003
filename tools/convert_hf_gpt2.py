"""Convert a Hugging Face GPT-2 checkpoint (a local folder) to a Megatron checkpoint.

    python tools/convert_hf_gpt2.py --hf-model-dir ./gpt2 --save ./ckpt/gpt2-megatron

writes ``SAVE/release/mp_rank_00/model_optim_rng.pt`` and ``latest_checkpointed_iteration.txt``
(``release``), loadable with ``--load SAVE --finetune`` (model only) at tensor and pipeline
parallel size 1, and prints the model flags that match it. Nothing is downloaded: the folder
must hold ``config.json`` and the weights. Resharding to other layouts is a later tool.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zipfile

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


# What from_pretrained reads, in its order of preference.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ConversionError(Exception):
    """The folder cannot be converted; the message names the flag or the file."""


def read_hf_config(hf_model_dir: str) -> dict:
    """``config.json`` of the folder, checked to be JSON describing a GPT-2."""
    if not os.path.isdir(hf_model_dir):
        raise ConversionError(f"--hf-model-dir {hf_model_dir!r} is not a folder")
    path = os.path.join(hf_model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"--hf-model-dir {hf_model_dir!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} must hold a JSON object, not {type(config).__name__}")
    if config.get("model_type", "gpt2") != "gpt2":
        raise ConversionError(f"{path}: model_type {config['model_type']!r}; this tool "
                              "converts GPT-2 (model_type 'gpt2')")
    return config


def find_weights(hf_model_dir: str) -> str:
    """The weights file from_pretrained will read."""
    for name in WEIGHT_FILES:
        path = os.path.join(hf_model_dir, name)
        if os.path.isfile(path):
            return path
    raise ConversionError(f"--hf-model-dir {hf_model_dir!r} holds no weights: none of "
                          f"{', '.join(WEIGHT_FILES)}")


def check_weights_file(path: str) -> None:
    """A quick look at the container before torch or safetensors parse it, so a corrupt file
    is named as such (their own errors suggest unsafe loading, or say nothing of the file)."""
    if path.endswith(".index.json"):
        return  # the shards it lists are checked by from_pretrained
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt"):
                return
        except Exception as e:  # SafetensorError is not importable under one stable name
            raise ConversionError(f"{path} is not a readable safetensors file (truncated or "
                                  f"corrupt?): {e}") from None
    with open(path, "rb") as f:
        head = f.read(2)
    # torch.save writes a zip archive; before PyTorch 1.6 a pickle (protocol 2: 0x80 0x02).
    if not zipfile.is_zipfile(path) and head != b"\x80\x02":
        raise ConversionError(f"{path} is not a PyTorch weights file (neither a complete zip "
                              "archive nor a pickle): truncated or corrupt?")


def load_hf_model(hf_model_dir: str):
    """The GPT2LMHeadModel of the folder; unreadable files raise ConversionError naming them."""
    from transformers import GPT2LMHeadModel

    read_hf_config(hf_model_dir)
    weights = find_weights(hf_model_dir)
    check_weights_file(weights)
    try:
        return GPT2LMHeadModel.from_pretrained(hf_model_dir, local_files_only=True)
    except Exception as e:  # safetensors, torch's unpickler and transformers each raise their own
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConversionError(f"cannot load the model from {weights} (with "
                              f"{os.path.join(hf_model_dir, 'config.json')}): "
                              f"{type(e).__name__}: {reason}") from e


def convert(hf_model_dir: str, save_dir: str, make_vocab_size_divisible_by: int = 128) -> str:
    import torch

    hf = load_hf_model(hf_model_dir)
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
    try:
        chmod_as_created(tmp)  # mkdtemp's 0700 would become release/'s mode
        os.makedirs(os.path.join(tmp, mp_rank_dir_name(0, 0, 1)))
        torch.save(state, os.path.join(tmp, mp_rank_dir_name(0, 0, 1), MODEL_FILENAME))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    try:
        flags = convert(args.hf_model_dir, args.save, args.make_vocab_size_divisible_by)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {os.path.join(args.save, 'release')}; train or evaluate it with:\n  {flags} "
          f"--load {args.save} --finetune")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
