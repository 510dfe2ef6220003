"""Files and folders the framework writes follow the umask (0644 / 0755 under umask 022), also
those first written under a private temporary name (tempfile's 0600 files, 0700 folders) and
renamed into place: checkpoints, converted checkpoints, the quick-start corpus, datasets,
index caches, TensorBoard events."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd, umask: int) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO,
                          env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO},
                          timeout=240, preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _wrong_modes(root, umask: int) -> list[str]:
    """Paths under ``root`` (itself included) whose permission bits are not what open() and
    os.mkdir() give under ``umask``."""
    wrong = []
    for folder, _, files in os.walk(root):
        for path in [folder] + [os.path.join(folder, f) for f in files]:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            want = (0o777 if os.path.isdir(path) else 0o666) & ~umask
            if mode != want:
                wrong.append(f"{os.path.relpath(path, root)}: {oct(mode)}, want {oct(want)}")
    return wrong


def test_training_outputs_follow_umask_022(corpus, tmp_path):
    out = tmp_path / "run"
    flags = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
             "--eval-iters", "1", "--eval-interval", "2", "--split", "90,5,5",
             "--num-workers", "0", "--use-cpu", "--data-path", corpus["prefix"],
             "--data-cache-path", out / "cache", "--save", out / "ckpt", "--save-interval", "1",
             "--tensorboard-dir", out / "tb", *corpus["tokenizer_flags"]]
    _run([sys.executable, "pretrain_gpt.py", *flags], 0o022)
    assert sorted(os.listdir(out / "ckpt")) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    assert os.listdir(out / "cache") and os.listdir(out / "tb")
    assert _wrong_modes(out, 0o022) == []


def test_tool_outputs_follow_umask_022(corpus, tmp_path):
    out = tmp_path / "tools"
    out.mkdir(mode=0o755)
    _run([sys.executable, "tools/build_quickstart_corpus.py", "corpus", "--output",
          out / "corpus.json", "--max-chars", "20000"],
         0o022)
    tok = corpus["tokenizer_flags"]
    _run([sys.executable, "tools/preprocess_data.py", "--input", out / "corpus.json",
          "--output-prefix", out / "docs", "--partitions", "2", "--workers", "2", *tok], 0o022)
    _run([sys.executable, "tools/merge_datasets.py", "--input", out / "docs_text_document",
          out / "docs_text_document", "--output-prefix", out / "twice"], 0o022)
    assert {"corpus.json", "docs_text_document.bin", "twice.idx"} <= set(os.listdir(out))
    assert _wrong_modes(out, 0o022) == []


def test_converted_checkpoint_follows_umask_022(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(hf)
    _run([sys.executable, "tools/convert_hf_gpt2.py", "--hf-model-dir", hf, "--save",
          tmp_path / "ckpt"], 0o022)
    assert _wrong_modes(tmp_path / "ckpt", 0o022) == []


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_chmod_as_created_gives_the_umask_mode(tmp_path, umask):
    script = ("import os, sys, tempfile; from megatron.platform.file_modes import chmod_as_created; "
              "d = tempfile.mkdtemp(dir=sys.argv[1]); fd, f = tempfile.mkstemp(dir=d); "
              "chmod_as_created(d); chmod_as_created(f); print(d)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": REPO},
                          preexec_fn=lambda: os.umask(umask), timeout=60)
    assert done.returncode == 0, done.stderr
    assert _wrong_modes(done.stdout.strip(), umask) == []

