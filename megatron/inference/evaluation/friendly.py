"""``tools/evaluate.py``: the zero-shot tasks with less to type.

    python tools/evaluate.py wikitext wiki.test.tokens --load CKPT
    python tools/evaluate.py lambada lambada_test.jsonl --load CKPT --strict
    python tools/evaluate.py wikitext wiki.test.tokens --hf-model ./gpt2

The command becomes ``tasks/main.py``'s: with ``--load`` (a checkpoint of any kind
``megatron.checkpointing.folder.find_checkpoint`` tells apart: ours, Megatron-LM's,
Megatron-DeepSpeed's, DeepSpeed's engines), the model's shape comes from the checkpoint
(``--use-checkpoint-args``), and so do the tokenizer it was trained with and its
tensor/pipeline layout, unless given (a launch whose process count the saved layout does not
divide runs at tensor and pipeline size 1, the checkpoint merged in memory); with
``--hf-model``, from the folder. Any other pretrain_gpt.py flag is passed on (flags given
win).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.run_config import stored_run_config
from megatron.inference.evaluation.cli import main as task_main
from megatron.inference.loading import (
    checkpoint_folder,
    checkpoint_tokenizer_settings,
    tokenizer_data_config,
)

_TASKS = {"wikitext": "WIKITEXT103", "wikitext103": "WIKITEXT103", "lambada": "LAMBADA"}
_TOKENIZER_FLAGS = ("--tokenizer-type", "--vocab-file", "--merge-file",
                    "--tokenizer-name-or-path", "--vocab-size")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/evaluate.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Any pretrain_gpt.py flag may follow (model shape, tokenizer, "
        "--micro-batch-size, --tensor-model-parallel-size, --log-interval ...); flags given "
        "win over what the checkpoint recorded.")
    p.add_argument("task", type=str.lower, choices=sorted(_TASKS),
                   help="wikitext (perplexity) or lambada (last-word accuracy)")
    p.add_argument("data", help="the text file (wikitext) or JSON lines file (lambada)")
    p.add_argument("--stride", type=int, default=None,
                   help="wikitext: tokens scored per window (--overlapping-eval; default: "
                   "--seq-length, windows that do not overlap)")
    p.add_argument("--strict", action="store_true", help="lambada: the whole last word "
                   "must be predicted (--strict-lambada)")
    model = p.add_argument_group("model (one of)").add_mutually_exclusive_group(required=True)
    model.add_argument("--load", metavar="CKPT", help="a checkpoint folder of any kind (ours, "
                       "Megatron-DeepSpeed's, DeepSpeed's plain or pipeline engine), saved at "
                       "any layout; its model shape, tokenizer and layout are used unless "
                       "given")
    model.add_argument("--hf-model", metavar="DIR", help="a local Hugging Face GPT-2 folder "
                       "(config.json, weights, and its vocab.json/merges.txt as the "
                       "tokenizer), converted in memory")
    return p


def _given(rest: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in rest)


def _checkpoint_flags(load_dir: str, rest: list[str]) -> list[str]:
    """What the checkpoint in ``load_dir`` can tell that ``rest`` does not: model shape,
    tokenizer files, tensor/pipeline layout."""
    try:
        folder = checkpoint_folder(load_dir)
        tp, pp = folder.layout()
        data = stored_run_config(folder).get("data", {})
    except CheckpointError as error:
        raise SystemExit(f"error: {error}") from None
    flags = [] if _given(rest, "--use-checkpoint-args") else ["--use-checkpoint-args"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    chosen = any(_given(rest, f) for f in ("--tensor-model-parallel-size",
                                            "--pipeline-model-parallel-size"))
    if not chosen and world % (tp * pp) == 0:  # the saved layout: each rank reads its file
        flags += ["--tensor-model-parallel-size", str(tp),
                  "--pipeline-model-parallel-size", str(pp)]
    elif not chosen:
        print(f"note: --load {load_dir} was saved at tensor parallel {tp} x pipeline parallel "
              f"{pp}; evaluating it at tensor and pipeline parallel 1 over {world} "
              "process(es), merged in memory", file=sys.stderr, flush=True)
    if not any(_given(rest, f) for f in _TOKENIZER_FLAGS):
        flags += _tokenizer_flags(data, load_dir)
    return flags


def _tokenizer_flags(data: dict[str, Any], load_dir: str) -> list[str]:
    """The tokenizer flags a checkpoint recorded (its ``data`` slice), a moved file found
    where ``megatron.inference.loading.checkpoint_tokenizer_settings`` finds it."""
    settings = checkpoint_tokenizer_settings(tokenizer_data_config(data), load_dir)
    return [part for key, value in settings.items() if value is not None
            for part in ("--" + key.replace("_", "-"), str(value))]


def task_argv(argv: Optional[list[str]] = None) -> list[str]:
    """tasks/main.py's flags for this command line."""
    known, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    out = ["--task", _TASKS[known.task], "--valid-data", known.data]
    if known.stride is not None:
        out += ["--overlapping-eval", str(known.stride)]
    elif known.task != "lambada" and not _given(rest, "--overlapping-eval"):
        out += ["--overlapping-eval", "0"]  # windows side by side
    if known.strict:
        out.append("--strict-lambada")
    if not _given(rest, "--micro-batch-size"):
        out += ["--micro-batch-size", "8"]
    if known.hf_model is not None:
        out += ["--hf-model", known.hf_model]
    else:
        out += ["--load", known.load, *_checkpoint_flags(known.load, rest)]
    return out + rest


def main(argv: Optional[list[str]] = None):
    return task_main(task_argv(argv))
