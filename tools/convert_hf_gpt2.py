"""Convert a Hugging Face GPT-2 checkpoint (a local folder) to a Megatron checkpoint.

    python tools/convert_hf_gpt2.py --hf-model-dir ./gpt2 --save ./ckpt/gpt2-megatron

Kept for existing scripts; it is ``tools/checkpoint/convert.py --model-type GPT --loader hf
--saver megatron --load-dir DIR --save-dir SAVE`` at tensor and pipeline parallel size 1 (that
tool also writes other layouts). Writes ``SAVE/release/mp_rank_00/model_optim_rng.pt`` and
``latest_checkpointed_iteration.txt`` (``release``), loadable with ``--load SAVE --finetune``,
and prints the model flags that match it. The folder's ``vocab.json`` and ``merges.txt``, when
it has them, are copied to ``SAVE/tokenizer/`` and recorded as the checkpoint's tokenizer
(``tools/evaluate.py`` then needs no tokenizer flags). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.conversion.hf import (  # noqa: E402
    ConversionError,
    load_hf_checkpoint,
    save_keeping_tokenizer,
)


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
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    return " ".join(flags)


def convert(hf_model_dir: str, save_dir: str, make_vocab_size_divisible_by: int = 128,
            tp: int = 1, pp: int = 1) -> str:
    """Write the HF folder as our checkpoint; returns the model flags that load it."""
    full = load_hf_checkpoint(hf_model_dir, make_vocab_size_divisible_by, flag="--hf-model-dir")
    save_keeping_tokenizer(full, save_dir, tp, pp, source=f"hf:{hf_model_dir}")
    return model_flags(full.model_config())


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
