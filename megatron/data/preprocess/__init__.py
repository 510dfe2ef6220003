"""Tokenize loose-JSON corpora (one JSON object per line) into Megatron ``.bin``/``.idx`` datasets.

The library behind ``tools/preprocess_data.py``, split along the pipeline's stages:
``config`` (flags and errors), ``reading`` (input spans and chunks), ``sentences`` (Punkt),
``encoding`` (JSON lines to tokens, in workers), ``workers`` (child processes), ``writing``
(datasets and progress) and ``pipeline`` (the run, partitions, exit statuses).

Writes ``{prefix}_{key}_document.bin/.idx`` per ``--json-keys`` key (``_sentence`` with
``--split-sentences``). The ``.bin`` is byte-identical to Megatron-DeepSpeed's for the same
input and flags; the ``.idx`` counts the appended EOD in the last sentence's size, as
Megatron-LM does. Documents keep input order whatever ``--workers`` and ``--partitions`` are.

Memory stays flat in corpus size: lines are streamed in chunks and at most a few chunks per
worker are in flight. Outputs are written under temporary names and renamed only when the
whole run succeeds; every exit the parent controls (an error, Ctrl-C, SIGTERM, a full disk,
a dead worker) removes them, and children die with the parent. Nothing here imports torch or
transformers (unless a Hugging Face tokenizer is asked for), so the tool starts quickly.
"""

from megatron.data.preprocess.config import (
    InputError,
    OutputError,
    PreprocessConfig,
    PreprocessError,
    WorkerDied,
    config_from_args,
    resolve_inputs,
)
from megatron.data.preprocess.pipeline import run, run_from_args
from megatron.data.preprocess.reading import CHUNK_BYTES, Chunk, Span, iter_chunks, plan_partitions

__all__ = [
    "CHUNK_BYTES", "Chunk", "InputError", "OutputError", "PreprocessConfig", "PreprocessError",
    "Span", "WorkerDied", "config_from_args", "iter_chunks", "plan_partitions",
    "resolve_inputs", "run", "run_from_args",
]
