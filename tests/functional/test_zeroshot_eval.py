"""Zero-shot evaluation (tasks/main.py, tools/evaluate.py): WikiText perplexity and LAMBADA
accuracy of a model converted from Hugging Face equal HF's own numbers, computed here
directly from the HF model on the same tokens; and every parallel layout gives the numbers
of one process (tests/distributed/test_zeroshot_layouts.py)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.inference.evaluation.detokenizer import wikitext_detokenizer
from tests import zeroshot_data
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import load_tool

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SEQ, STRIDE = 64, 24
# Pads the 512-id vocabulary to 768 at tp 1 and tp 2: the padding's logits must not count.
DIVISIBLE_BY = 384


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 512-id BPE, a tiny random GPT2LMHeadModel saved as an HF folder (with the tokenizer
    files), its conversion to our checkpoint, a WikiText file and a LAMBADA file."""
    root = tmp_path_factory.mktemp("zeroshot")
    texts = zeroshot_data.texts()
    tok, tok_flags = zeroshot_data.train_tokenizer(texts, root / "tokenizer")
    # A wide initialisation makes the greedy predictions depend on the context.
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=SEQ, n_embd=32,
                                  n_layer=2, n_head=4, initializer_range=0.3,
                                  bos_token_id=tok.eod, eos_token_id=tok.eod)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf_dir = root / "hf"
    hf.save_pretrained(hf_dir)
    shutil.copy(tok_flags[3], hf_dir / "vocab.json")
    shutil.copy(tok_flags[5], hf_dir / "merges.txt")
    ckpt = root / "ckpt"
    convert = load_tool("convert_hf_gpt2")
    model_flags = convert.convert(str(hf_dir), str(ckpt), DIVISIBLE_BY).split()
    wiki = root / "wiki.valid.txt"  # "wiki" in the name picks the WikiText detokenizer
    zeroshot_data.write_wikitext(wiki, texts, 12_000)
    lambada = root / "lambada.jsonl"

    def hf_next_token(ids: list[int]) -> int:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1].argmax().item()

    zeroshot_data.write_lambada(lambada, texts, tok, hf_next_token, SEQ - 4)
    return dict(root=root, hf=hf, tok=tok, hf_dir=str(hf_dir), ckpt=str(ckpt),
                model_flags=model_flags, wiki=str(wiki), lambada=str(lambada),
                tok_flags=tok_flags)


# HF's numbers, computed here from the model and the tokenizer ------------------------------


def _hf_windows_loss(hf, tokens: list[int]) -> float:
    """Summed loss over windows of SEQ targets, STRIDE apart; window 0 scores all of its
    targets, each later one its last STRIDE."""
    total, start, ids = 0.0, 0, torch.tensor(tokens)
    while True:
        window = ids[start:start + SEQ + 1]
        with torch.no_grad():
            logits = hf(window[None, :-1]).logits[0]
        losses = torch.nn.functional.cross_entropy(logits, window[1:], reduction="none")
        total += (losses if start == 0 else losses[SEQ - STRIDE:]).sum().item()
        if start + SEQ >= len(tokens) - 1:
            return total
        start += STRIDE


def _hf_lambada_correct(hf, tok, path: str, strict: bool) -> list[bool]:
    right = []
    for line in Path(path).read_text().splitlines():
        text = json.loads(line)["text"]
        if strict:
            word = text.split()[-1]
            context = tok.tokenize(text[:text.rfind(word)].strip())
            target = tok.tokenize(" " + word)
        else:
            ids = tok.tokenize(text)
            context, target = ids[:-1], ids[-1:]
        with torch.no_grad():
            logits = hf(torch.tensor([context + target])).logits[0]
        predicted = logits[len(context) - 1:-1].argmax(-1).tolist()
        right.append(predicted == target)
    return right


def _run_tasks(rank, world_size, argvs):
    from megatron.inference.evaluation.cli import main

    return [main(argv) for argv in argvs]


def _task_argv(s, task: str, *extra: str) -> list[str]:
    data = s["wiki"] if task == "WIKITEXT103" else s["lambada"]
    return ["--task", task, "--valid-data", data, "--overlapping-eval", str(STRIDE),
            "--micro-batch-size", "4", "--use-cpu", *extra]


@pytest.fixture(scope="module")
def ours(setup):
    """tasks/main.py's results, all from one process: WikiText of the converted checkpoint
    and of the HF folder (converted in memory, tokenizer files from it), LAMBADA non-strict
    and strict."""
    s = setup
    ckpt = ["--load", s["ckpt"], *s["model_flags"], *s["tok_flags"]]
    argvs = {"wikitext": _task_argv(s, "WIKITEXT103", *ckpt),
             "wikitext-hf": _task_argv(s, "WIKITEXT103", "--hf-model", s["hf_dir"]),
             "lambada": _task_argv(s, "LAMBADA", *ckpt),
             "lambada-strict": _task_argv(s, "LAMBADA", *ckpt, "--strict-lambada")}
    results = run_distributed(_run_tasks, 1, list(argvs.values()))[0]
    return dict(zip(argvs, results))


@pytest.fixture(scope="module")
def hf_wikitext(setup):
    """HF's loss per token and the token ratio on the WikiText file."""
    raw = Path(setup["wiki"]).read_text(encoding="utf-8")
    tokens = setup["tok"].tokenize(wikitext_detokenizer(raw))
    words = len(raw.strip().split(" "))
    loss = _hf_windows_loss(setup["hf"], tokens) / (len(tokens) - 1)
    return loss, (len(tokens) - 1) / (words - 1)


@pytest.mark.parametrize("source", ["wikitext", "wikitext-hf"])
def test_wikitext_perplexity_of_a_converted_model_equals_hf(ours, hf_wikitext, source):
    result = ours[source]
    loss, ratio = hf_wikitext
    assert result.avg_loss == pytest.approx(loss, rel=1e-3)
    assert result.ppl == pytest.approx(math.exp(loss), rel=1e-3)
    assert result.adjusted_ppl == pytest.approx(math.exp(loss * ratio), rel=1e-3)
    assert result.token_ratio == pytest.approx(ratio, rel=1e-12)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_lambada_accuracy_of_a_converted_model_equals_hf(setup, ours, strict):
    s = setup
    expected = _hf_lambada_correct(s["hf"], s["tok"], s["lambada"], strict)
    assert 0 < sum(expected) < len(expected), "the file must hold right and wrong answers"
    result = ours["lambada-strict" if strict else "lambada"]
    assert (result.correct, result.total) == (sum(expected), len(expected))
    assert result.accuracy == pytest.approx(sum(expected) / len(expected))


def test_hf_folder_at_tensor_parallel_2_gives_the_one_process_numbers(setup, ours):
    """--hf-model at tp 2: the folder converted and cut for each rank in memory."""
    s = setup
    argv = _task_argv(s, "WIKITEXT103", "--hf-model", s["hf_dir"],
                      "--tensor-model-parallel-size", "2")
    expected = ours["wikitext-hf"]
    for (result,) in run_distributed(_run_tasks, 2, [argv]):
        assert result.avg_loss == pytest.approx(expected.avg_loss, rel=1e-5)
        assert result.token_ratio == expected.token_ratio


def test_tools_evaluate_reads_the_model_and_tokenizer_from_the_checkpoint(setup, hf_wikitext):
    """tools/evaluate.py: model flags, layout and tokenizer files (the HF folder's vocab.json
    and merges.txt, which the conversion copied into CKPT/tokenizer/ and recorded) from the
    checkpoint, Megatron's line out; no tokenizer flag given. Progress lines with the ETA
    every --log-interval micro-batches, as preprocessing prints them."""
    s = setup
    from megatron.checkpointing import load_checkpoint_config

    data = load_checkpoint_config(s["ckpt"])["data"]
    assert data["tokenizer_type"] == "GPT2BPETokenizer"
    for key, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        assert Path(data[key]) == Path(s["ckpt"]).resolve() / "tokenizer" / name
        assert Path(data[key]).read_bytes() == (Path(s["hf_dir"]) / name).read_bytes()
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "evaluate.py"), "wikitext", s["wiki"],
         "--stride", str(STRIDE), "--load", s["ckpt"], "--use-cpu", "--log-interval", "4"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = re.search(r"^ validation results on WIKITEXT103 \| avg loss: (\S+) \| ppl: (\S+) \| "
                     r"adjusted ppl: (\S+) \| token ratio: (\S+) \|$", done.stdout, re.M)
    assert line, done.stdout[-3000:]
    loss, ratio = hf_wikitext
    assert float(line.group(1)) == pytest.approx(loss, rel=1e-3)
    assert float(line.group(4)) == pytest.approx(ratio, rel=1e-9)
    progress = re.findall(r"^> evaluated (\d+) of (\d+) micro-batches, ([\d.]+)% done, ETA "
                          r"(\d+:\d\d:\d\d) \([\d.]+ micro-batches/s\)$", done.stdout, re.M)
    total = int(progress[-1][1]) if progress else 0
    assert total > 8 and [int(p[0]) for p in progress] == [
        *range(4, total, 4), total], done.stdout[-3000:]
    assert float(progress[0][2]) == pytest.approx(400 / total, abs=0.06)
    assert progress[-1][2:] == ("100.0", "0:00:00")
