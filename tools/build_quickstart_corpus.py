"""Build the quickstart's corpus (loose JSON) and byte-level BPE tokenizer, offline.

    python tools/build_quickstart_corpus.py corpus --output quickstart/corpus/corpus.json
    python tools/build_quickstart_corpus.py tokenizer --input quickstart/corpus/corpus.json \
        --output-dir quickstart/tokenizer --vocab-size 8192

``corpus`` writes one ``{"text": ...}`` JSON object per line (what tools/preprocess_data.py
reads). Its source is WikiText-2 cut into articles: the folder ``--wikitext-dir`` names (an
error when it holds none), or without the flag ``<repo>/../shared/data/wikitext-2`` when that
folder exists, or else Python's own documentation, which every Python installation carries:
the language reference topics of ``pydoc_data`` and the docstrings of the standard library's
modules.

``tokenizer`` trains a byte-level BPE with Hugging Face ``tokenizers`` and writes it in GPT-2's
format (``vocab.json`` + ``merges.txt``), with ``<|endoftext|>`` as the last id as in GPT-2, so
``--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...`` reads it.

Both steps write to a temporary name and rename when complete, and do nothing when their
outputs already exist (``--force`` rebuilds), so a re-run reuses what was built.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.platform.file_modes import chmod_as_created  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"
EOD_TOKEN = "<|endoftext|>"
# WikiText's tokenized number and hyphen forms ("1 @,@ 000", "state @-@ of") back to text.
_WIKITEXT_MARKERS = re.compile(r" @([-,.])@ ")
# Standard-library folders that are tests, tools or vendored code rather than documentation.
_SKIP_STDLIB_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
                     "lib2to3", "turtledemo", "ensurepip", "tkinter"}


# Sources --------------------------------------------------------------------------------


def wikitext_articles(path: Path) -> Iterator[str]:
    """The articles of one WikiText raw file, cut at its top-level ``= Title =`` headings."""
    current: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if stripped.startswith("= ") and not stripped.startswith("= =") and current:
                yield _clean_wikitext("".join(current))
                current = []
            current.append(line)
    if current:
        yield _clean_wikitext("".join(current))


def _clean_wikitext(text: str) -> str:
    return _WIKITEXT_MARKERS.sub(r"\1", text).strip()


def wikitext_documents(folder: Path) -> Iterator[str]:
    """Every non-empty article of the WikiText raw files in ``folder`` (train, valid, test)."""
    for split in ("train", "valid", "test"):
        for name in (f"{split}.txt", f"wiki.{split}.raw", f"wiki.{split}.tokens"):
            path = folder / name
            if path.is_file():
                yield from (a for a in wikitext_articles(path) if a)
                break


def python_doc_documents(max_chars: int = 4_000_000) -> Iterator[str]:
    """Python's own documentation: the language reference topics, then one document per
    standard-library module made of its docstrings, in a fixed order, up to ``max_chars``."""
    total = 0
    for text in _python_doc_sources():
        if total >= max_chars:
            return
        text = text.strip()
        if len(text) >= 200:  # a one-line docstring teaches a tokenizer little
            total += len(text)
            yield text


def _python_doc_sources() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        yield topics[name]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files(stdlib):
        yield _module_docstrings(path)


def _stdlib_files(stdlib: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_STDLIB_DIRS
                         and not d.startswith(("python", "config-")))
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(root) / name


def _module_docstrings(path: Path) -> str:
    """The docstrings of a module, its classes and functions, separated by blank lines."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return "\n\n".join(d for d in docs if d)


def read_json_texts(path: Path, key: str = "text") -> Iterator[str]:
    """The ``key`` field of each line of a loose-JSON file (what preprocess_data.py reads)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: expected a JSON object with a string "
                                 f"{key!r} field ({type(error).__name__}: {error})") from None
            if isinstance(value, str):
                yield value


# Outputs --------------------------------------------------------------------------------


def write_loose_json(documents: Iterable[str], output: Path) -> int:
    """Write ``{"text": doc}`` lines to ``output`` atomically; returns the document count."""
    output.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    fd, tmp = tempfile.mkstemp(prefix=output.name + ".tmp-", dir=output.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for doc in documents:
                f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                count += 1
        if count == 0:
            raise ValueError(f"no documents to write to {output}")
        chmod_as_created(tmp)  # mkstemp's 0600 would become the corpus file's mode
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return count


def check_wikitext_dir(folder: Path) -> None:
    """Raise ValueError naming --wikitext-dir unless ``folder`` holds WikiText raw text (a
    folder the user names must be the corpus; only the default may fall back)."""
    if not Path(folder).is_dir():
        raise ValueError(f"--wikitext-dir {folder}: no such folder")
    if not any(wikitext_documents(Path(folder))):
        raise ValueError(f"--wikitext-dir {folder}: holds no WikiText raw text (train.txt, "
                         "valid.txt, test.txt or wiki.*.raw/tokens with articles)")


def build_corpus(output: Path, wikitext_dir: Optional[Path] = DEFAULT_WIKITEXT,
                 max_chars: int = 4_000_000) -> tuple[str, int]:
    """Write the built-in corpus to ``output``; returns (source description, documents)."""
    if wikitext_dir is not None and any(wikitext_documents(Path(wikitext_dir))):
        source = f"WikiText-2 articles from {wikitext_dir}"
        documents = wikitext_documents(Path(wikitext_dir))
    else:
        source = "Python's documentation (pydoc topics and standard-library docstrings)"
        documents = python_doc_documents(max_chars)
    return source, write_loose_json(documents, output)


def train_tokenizer(texts: Iterable[str], output_dir: Path, vocab_size: int = 8192,
                    min_frequency: int = 2) -> tuple[Path, Path]:
    """Train a byte-level BPE on ``texts``; write GPT-2-format ``vocab.json``/``merges.txt``
    with ``<|endoftext|>`` as the last id. Returns (vocab path, merges path)."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257 + 1:
        raise ValueError(f"--vocab-size {vocab_size} is below the 256 byte symbols plus "
                         f"{EOD_TOKEN}")
    tokenizer = ByteLevelBPETokenizer()
    # The end-of-document token is appended after training so that, as in GPT-2, it is the
    # last id rather than the first.
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size - 1, min_frequency=min_frequency,
                                  show_progress=False)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir) as tmp:
        tokenizer.save_model(tmp)
        vocab = json.loads(Path(tmp, "vocab.json").read_text(encoding="utf-8"))
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise RuntimeError("the trained vocabulary's ids are not 0..n-1")
        vocab[EOD_TOKEN] = len(vocab)
        Path(tmp, "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False),
                                           encoding="utf-8")
        merges = output_dir / "merges.txt"
        vocab_path = output_dir / "vocab.json"
        os.replace(Path(tmp, "merges.txt"), merges)
        os.replace(Path(tmp, "vocab.json"), vocab_path)  # last: its presence marks "done"
    return vocab_path, merges


# Command line ---------------------------------------------------------------------------


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="write the built-in corpus as loose JSON")
    corpus.add_argument("--output", type=Path, required=True, help="the .json file to write")
    corpus.add_argument("--wikitext-dir", type=Path, default=None,
                        help="folder with WikiText-2 raw text (valid.txt, test.txt, ...), "
                        "which must hold some; without the flag <repo>/../shared/data/"
                        "wikitext-2 is used if present, else Python's documentation")
    corpus.add_argument("--max-chars", type=int, default=4_000_000,
                        help="size cap of the Python-documentation fallback")
    corpus.add_argument("--force", action="store_true", help="rebuild an existing output")
    tok = sub.add_parser("tokenizer", help="train a GPT-2-format byte-level BPE")
    tok.add_argument("--input", type=Path, required=True, help="loose JSON, one object a line")
    tok.add_argument("--json-key", default="text")
    tok.add_argument("--output-dir", type=Path, required=True)
    tok.add_argument("--vocab-size", type=int, default=8192,
                     help="ids including the final <|endoftext|>")
    tok.add_argument("--min-frequency", type=int, default=2)
    tok.add_argument("--force", action="store_true", help="retrain an existing tokenizer")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.command == "corpus":
        if args.wikitext_dir is not None:
            try:
                check_wikitext_dir(args.wikitext_dir)
            except ValueError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
        if args.output.is_file() and not args.force:
            print(f"   reusing {args.output}", flush=True)
            return 0
        source, count = build_corpus(args.output, args.wikitext_dir or DEFAULT_WIKITEXT,
                                     args.max_chars)
        print(f"   wrote {count} documents ({source}) to {args.output}", flush=True)
        return 0
    vocab, merges = args.output_dir / "vocab.json", args.output_dir / "merges.txt"
    if vocab.is_file() and merges.is_file() and not args.force:
        print(f"   reusing {vocab} and {merges}", flush=True)
        return 0
    if not args.input.is_file():
        print(f"error: --input {args.input} does not exist", file=sys.stderr)
        return 2
    try:
        vocab, merges = train_tokenizer(read_json_texts(args.input, args.json_key),
                                        args.output_dir, args.vocab_size, args.min_frequency)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    size = len(json.loads(vocab.read_text(encoding="utf-8")))
    print(f"   trained a byte-level BPE of {size} ids ({EOD_TOKEN} = {size - 1}) into "
          f"{vocab} and {merges}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
