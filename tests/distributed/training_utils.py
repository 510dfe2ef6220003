"""Helpers for tests that drive pretrain() end to end: a small real-text corpus, the flags of
a tiny GPT, a data-order recorder, and a parser for the Megatron log line.

The corpus is WikiText-2 (or, without ../shared/data, Python's own documentation) through a
byte-level BPE of ``vocab_size`` ids trained by tools/build_quickstart_corpus.py, written as a
.bin/.idx dataset. A 512-id vocabulary keeps the output layer, which dominates a tiny GPT's
cost, small.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import math
import os
import sys
from pathlib import Path

import numpy as np

from megatron.training.log import parse_log_lines  # noqa: F401  (tests import it from here)

REPO = Path(__file__).resolve().parents[2]


def load_tool(name: str):
    """A module of tools/ by file name (tools/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str):
    """A module of benchmarks/ by file name, registered in ``sys.modules`` under it (the
    dataclasses of a module look themselves up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build_small_corpus(out_dir: str, vocab_size: int = 512, max_chars: int = 300_000) -> dict:
    """Write ``{out_dir}/small_text_document.{bin,idx}``; return its prefix and the tokenizer
    flags to train on it."""
    from megatron.data.indexed_dataset import make_builder
    from megatron.tokenizer import build_tokenizer

    tool = load_tool("build_quickstart_corpus")
    folder = Path(tool.DEFAULT_WIKITEXT)
    texts = list(_take_chars(tool.wikitext_documents(folder), max_chars))
    if not texts:
        texts = list(_take_chars(tool.python_doc_documents(), max_chars))
    vocab, merges = tool.train_tokenizer(texts, Path(out_dir) / "tokenizer", vocab_size)
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    prefix = os.path.join(out_dir, "small_text_document")
    builder = make_builder(prefix + ".bin", vocab_size=tokenizer.vocab_size)
    for text in texts:
        ids = np.asarray(tokenizer.tokenize(text) + [tokenizer.eod], dtype=np.int64)
        builder.add_doc(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
             "--merge-file", str(merges)]
    return {"prefix": prefix, "tokenizer_flags": flags, "vocab_size": tokenizer.vocab_size}


def _take_chars(texts, max_chars: int):
    """Documents from ``texts`` until about ``max_chars`` characters are taken."""
    for text in texts:
        yield text
        max_chars -= len(text)
        if max_chars <= 0:
            return


def base_argv(corpus: dict, cache_dir: str, **overrides) -> list[str]:
    """Flags of a tiny fp32 GPT on ``corpus``; ``overrides`` maps flag -> value (True: a bare
    switch, None/False: drop the flag). ``--use-cpu`` keeps these runs on the CPU where a GPU
    is visible too: their ranks share one machine's gloo groups (``"--use-cpu": None`` lets a
    one-process run take the GPU)."""
    flags = {
        "--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4,
        "--seq-length": 32, "--max-position-embeddings": 32, "--micro-batch-size": 2,
        "--global-batch-size": 4, "--train-iters": 10, "--lr": 3e-3, "--min-lr": 3e-4,
        "--lr-warmup-iters": 2, "--lr-decay-style": "cosine", "--clip-grad": 1.0,
        "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--log-interval": 1,
        "--eval-interval": 1000, "--eval-iters": 0, "--num-workers": 0, "--split": "98,2,0",
        "--make-vocab-size-divisible-by": 64, "--seed": 1234,
        "--data-path": corpus["prefix"], "--data-cache-path": cache_dir, "--use-cpu": True,
    }
    flags.update(overrides)
    return flags_to_argv(flags) + corpus["tokenizer_flags"]


# The Llama family's options (issue 32) on the same tiny model: what the layout tests run
# beside GPT's flags as a model-family parameter.
LLAMA_FLAGS = {
    "--normalization": "RMSNorm", "--swiglu": True, "--group-query-attention": True,
    "--num-query-groups": 2, "--position-embedding-type": "rope",
    "--untie-embeddings-and-output-weights": True, "--disable-bias-linear": True,
}
FAMILIES = {"gpt": {}, "llama": LLAMA_FLAGS}


def flags_to_argv(flags: dict) -> list[str]:
    """Command-line flags from ``{flag: value}``: True gives the bare flag, None and False
    leave it out, anything else gives ``flag str(value)``."""
    argv = []
    for name, value in flags.items():
        if value is True:
            argv.append(name)
        elif value is not None and value is not False:
            argv += [name, str(value)]
    return argv


@contextlib.contextmanager
def captured_stdout():
    """``with captured_stdout() as out: ...``; ``out.getvalue()`` is what was printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield buffer


class RecordingIterator:
    """Wraps a data iterator; ``log`` gets a short hash of every micro-batch it hands out, so
    tests can compare the data order of two runs."""

    def __init__(self, iterator, log: list) -> None:
        self.iterator, self.log = iterator, log

    def __iter__(self):
        return self

    def __next__(self):
        sample = next(self.iterator)
        text = sample["text"].numpy().tobytes()
        self.log.append(hashlib.sha1(text).hexdigest()[:12])
        return sample


def run_norms(history) -> list[tuple]:
    """(lm loss, grad norm, params norm) of each iteration of a run's history."""
    return [(h["losses"]["lm loss"], h["grad_norm"], h["params_norm"]) for h in history]


def assert_same_run(got, expected, iters: int, rel: float = 1e-5) -> None:
    """Two runs' ``run_norms`` agree, iteration by iteration, within ``rel``."""
    assert len(got) == len(expected) == iters
    for i, (step, ref_step) in enumerate(zip(got, expected)):
        for name, value, ref in zip(("loss", "grad norm", "params norm"), step, ref_step):
            assert math.isclose(value, ref, rel_tol=rel), (i, name, value, ref)
