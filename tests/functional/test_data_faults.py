"""Bad data and tool input, as a careful user would try them (issue 13, cases 3, 6 and 8).

Each case runs the real command and checks its exit status, its message (which names the flag
or the file), and that nothing was built or left behind: pretrain_gpt.py stops before any
process group or model exists, with ``error: ...`` and status 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from tests.distributed.training_utils import base_argv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(tmp_path) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # A user cache folder of the test's own, to see that nothing falls back to it.
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "XDG_CACHE_HOME": str(tmp_path / "user-cache")}


def _pretrain(corpus, tmp_path, **overrides) -> subprocess.CompletedProcess:
    flags = {"--train-iters": 4, "--data-cache-path": str(tmp_path / "cache"),
             "--save": str(tmp_path / "ckpt"), "--save-interval": 1, **overrides}
    argv = base_argv(corpus, flags.pop("--data-cache-path"), **flags)
    return subprocess.run([sys.executable, "pretrain_gpt.py", *argv], capture_output=True,
                          text=True, cwd=REPO, env=_env(tmp_path), timeout=240)


def _assert_refused(done, tmp_path, *words) -> None:
    """Status 2, ``error: ...`` naming ``words``, no model built, nothing written."""
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 2, output
    assert done.stderr.startswith("error: "), output
    assert "Traceback" not in done.stderr, output
    for word in words:
        assert word in done.stderr, output
    assert "building GPT model" not in done.stdout and " iteration " not in done.stdout
    assert not (tmp_path / "ckpt").exists()
    assert not (tmp_path / "user-cache").exists()
    cache = tmp_path / "cache"
    assert not cache.exists() or not [n for n in os.listdir(cache) if n.endswith(".npy")]


def _copy(corpus, tmp_path, name="data") -> str:
    prefix = str(tmp_path / name)
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus["prefix"] + suffix, prefix + suffix)
    return prefix


def _set_dtype_code(prefix, code) -> None:
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[17] = code
    open(prefix + ".idx", "wb").write(bytes(raw))


def _write(prefix, docs, dtype=np.uint16) -> str:
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_doc(np.asarray(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


# Case 3: the loader refuses what inspect_dataset --check refuses; ids beyond the vocabulary.


def test_idx_with_another_dtype_code(corpus, tmp_path):
    prefix = _copy(corpus, tmp_path)
    _set_dtype_code(prefix, 1)  # uint16 tokens read as uint8: trained on garbage before
    done = _pretrain(corpus, tmp_path, **{"--data-path": prefix})
    _assert_refused(done, tmp_path, "--data-path", prefix + ".idx", "dtype code 1 (uint8)")


def test_idx_with_another_datasets_larger_bin(corpus, tmp_path):
    prefix = _copy(corpus, tmp_path)
    _write(str(tmp_path / "small"), [[1, 2, 3, 4, 5]] * 20)
    shutil.copy(prefix + ".bin", tmp_path / "small.bin")  # the corpus' .bin is larger
    done = _pretrain(corpus, tmp_path, **{"--data-path": str(tmp_path / "small")})
    _assert_refused(done, tmp_path, str(tmp_path / "small.bin"), "longer than the index")


def test_token_ids_beyond_the_vocabulary(corpus, tmp_path):
    # 60000 is past GPT-2's padded vocabulary (50304) too: before, an IndexError in training.
    prefix = _write(str(tmp_path / "big"), [[1, 2, 3] * 30, [4, 60000, 6] * 30])
    done = _pretrain(corpus, tmp_path, **{"--data-path": prefix})
    vocab = corpus["tokenizer_flags"][corpus["tokenizer_flags"].index("--vocab-file") + 1]
    size = len(json.load(open(vocab, encoding="utf-8")))
    _assert_refused(done, tmp_path, prefix + ".bin", "largest token id is 60000",
                    f"vocabulary of {size} ids", f"--vocab-file {vocab}")


def test_good_data_trains_and_its_token_range_is_cached(corpus, tmp_path):
    done = _pretrain(corpus, tmp_path, **{"--save": None, "--save-interval": None})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [name] = [n for n in os.listdir(tmp_path / "cache") if n.endswith("_token_range.json")]
    cached = json.load(open(tmp_path / "cache" / name))
    assert cached["data_prefix"] == os.path.abspath(corpus["prefix"])
    assert cached["bin_bytes"] == os.path.getsize(corpus["prefix"] + ".bin")


@pytest.mark.slow
def test_blend_of_megatron_deepspeed_datasets_trains_with_eval_iters_0(corpus, tmp_path):
    """Issue 22 items 1 and 2: a blend of two datasets as Megatron-DeepSpeed's
    preprocess_data.py --append-eod writes them trains, with one warning per dataset, and
    with --eval-iters 0 builds no validation dataset though the split holds documents (an
    empty one stopped every rank: "no samples to consume")."""
    from tests.unit.data.corpus import uncount_eods

    a, b = _copy(corpus, tmp_path, "a"), _copy(corpus, tmp_path, "b")
    uncount_eods(a)
    uncount_eods(b)
    done = _pretrain(corpus, tmp_path, **{"--data-path": f"0.3 {a} 0.7 {b}", "--split": "90,10,0",
                                          "--eval-iters": 0, "--eval-interval": 2,
                                          "--save": None, "--save-interval": None})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " iteration        4/       4 |" in done.stdout
    warned = [line for line in done.stderr.splitlines() if "--append-eod index" in line]
    assert len(warned) == 2 and warned[0].startswith(f"{a}.idx is Megatron-DeepSpeed's")
    assert warned[1].startswith(f"{b}.idx is Megatron-DeepSpeed's")
    assert "no samples asked for, so no valid dataset" in done.stdout
    assert "last validation loss: none" in done.stdout


# Case 6: found before the model is built.


@pytest.mark.parametrize("missing", [(".idx", ".bin"), (".bin",)])
def test_data_path_that_does_not_exist(corpus, tmp_path, missing):
    prefix = _copy(corpus, tmp_path)
    for suffix in missing:
        os.remove(prefix + suffix)
    done = _pretrain(corpus, tmp_path, **{"--data-path": prefix})
    _assert_refused(done, tmp_path, "--data-path", *(prefix + s for s in missing))
    if missing == (".bin",):
        assert prefix + ".idx" not in done.stderr


def test_empty_training_split(corpus, tmp_path):
    done = _pretrain(corpus, tmp_path, **{"--split": "0,100,0"})
    _assert_refused(done, tmp_path, "--split 0,100,0", "gives training no weight",
                    corpus["prefix"])


def test_dataset_with_no_documents(corpus, tmp_path):
    prefix = _write(str(tmp_path / "empty"), [])
    done = _pretrain(corpus, tmp_path, **{"--data-path": prefix})
    _assert_refused(done, tmp_path, "--data-path", prefix + ".idx", "no documents")


# Case 8: the files of pretrain_gpt.py's flags.


def test_data_cache_path_that_is_not_writable(corpus, tmp_path):
    (tmp_path / "a-file").write_text("")  # even root cannot make a folder inside a file
    cache = str(tmp_path / "a-file" / "cache")
    done = _pretrain(corpus, tmp_path, **{"--data-cache-path": cache})
    _assert_refused(done, tmp_path, f"--data-cache-path {cache!r}", "not a writable folder")


def test_a_full_data_cache_path_is_one_error_naming_the_file_and_the_space(corpus, tmp_path):
    """Two ranks build the index cache on a disk that fills up: one ``error:`` line (not a
    traceback per rank) naming the file, the bytes needed and free, and the flag; the part of
    the set written is removed, and nothing trains."""
    from tests.checkpoint_utils import small_tmpfs
    from tests.dist_utils import free_port

    with small_tmpfs(tmp_path / "cache", 8192) as cache:
        argv = base_argv(corpus, cache, **{"--train-iters": 4, "--split": "90,5,5"})
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master_port", str(free_port()), "pretrain_gpt.py", *argv],
            capture_output=True, text=True, cwd=REPO, env=_env(tmp_path), timeout=240)
        left = sorted(os.listdir(cache))
    output = done.stdout[-3000:] + done.stderr[-3000:]
    # No rank's traceback (torchrun's own report of the failed worker follows, as for any).
    assert done.returncode != 0 and "OSError" not in done.stderr, output
    assert "megatron/" not in done.stderr and 'pretrain_gpt.py", line' not in done.stderr, output
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert re.fullmatch(r"error: the dataset index cache: cannot write " + re.escape(cache)
                        + r"/\w+_(doc|sample|shuffle)_idx\.npy: no space left on device "
                        r"\(\d+ bytes needed, \d+ free in " + re.escape(cache) + r"\); free "
                        r"space there or point --data-cache-path elsewhere", errors[0]), errors
    assert not [n for n in left if n.endswith(".npy")], left  # no part of a set is left
    assert " iteration " not in done.stdout


@pytest.mark.parametrize("damage", ["cut", "binary"])
def test_merges_file_cut_mid_line_or_binary(corpus, tmp_path, damage):
    flags = list(corpus["tokenizer_flags"])
    at = flags.index("--merge-file") + 1
    raw = open(flags[at], "rb").read()
    merges = tmp_path / "merges.txt"
    # Cut inside the second word of line 3 (the first merges are of two bytes each: cut a
    # multi-byte word in half) or replaced by bytes that are no text.
    lines = raw.split(b"\n")
    cut = len(b"\n".join(lines[:2])) + 1 + len(lines[2]) - 1
    merges.write_bytes(raw[:cut] if damage == "cut" else bytes(range(128, 256)) * 8)
    flags[at] = str(merges)
    argv = base_argv({"prefix": corpus["prefix"], "tokenizer_flags": flags},
                     str(tmp_path / "cache"), **{"--train-iters": 4, "--save-interval": 1,
                                                 "--save": str(tmp_path / "ckpt")})
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], capture_output=True,
                          text=True, cwd=REPO, env=_env(tmp_path), timeout=240)
    _assert_refused(done, tmp_path, f"--merge-file {str(merges)!r}", "line ")


# Case 8: the tools.


def _tool(name, *args, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"tools/{name}", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=_env(tmp_path),
                          timeout=240)


def test_merge_datasets_into_a_missing_folder(corpus, tmp_path):
    out = tmp_path / "missing" / "merged"
    done = _tool("merge_datasets.py", "--input", corpus["prefix"], corpus["prefix"],
                 "--output-prefix", out, tmp_path=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: --output-prefix") and str(tmp_path / "missing") in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "missing").exists()


def test_quickstart_corpus_with_a_wikitext_dir_that_does_not_exist(tmp_path):
    out = tmp_path / "corpus.json"
    done = _tool("build_quickstart_corpus.py", "corpus", "--output", out, "--wikitext-dir",
                 tmp_path / "nonexistent", "--max-chars", 20000, tmp_path=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: --wikitext-dir") and "no such folder" in done.stderr
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    path = tmp_path_factory.mktemp("hf")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path


def _hf_copy(hf_dir, tmp_path, damage):
    path = tmp_path / "hf"
    shutil.copytree(hf_dir, path)
    if damage == "config":
        (path / "config.json").write_text('{"n_embd": 16,\n  "n_layer": ')
        return path, path / "config.json", "not valid JSON"
    if damage == "no weights":
        os.remove(path / "model.safetensors")
        return path, path, "holds no weights"
    if damage == "safetensors":
        raw = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(bytes(b ^ 0x5A for b in raw[:4000]))
        return path, path / "model.safetensors", "not a readable safetensors file"
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    os.remove(path / "model.safetensors")
    raw = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(raw[: len(raw) // 2])  # a copy cut short
    return path, path / "pytorch_model.bin", "not a PyTorch weights file"


@pytest.mark.parametrize("damage", ["config", "no weights", "safetensors", "bin"])
def test_convert_hf_gpt2_with_damaged_files(hf_dir, tmp_path, capsys, damage):
    from tools import convert_hf_gpt2

    path, named, words = _hf_copy(hf_dir, tmp_path, damage)
    save = tmp_path / "ckpt"
    assert convert_hf_gpt2.main(["--hf-model-dir", str(path), "--save", str(save)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(named) in err and words in err, err
    assert not save.exists()
