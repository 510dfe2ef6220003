"""Zero-shot evaluation over a checkpoint at its own layout: tensor parallel 2, pipeline
parallel 2 and data parallel 2 give the WikiText loss of one process within 1e-5 and the
same LAMBADA answers, with real gloo ranks.

Weights are drawn independently of the layout (megatron/model/init.py), so each layout saves
the same random model; each evaluates what it saved. The LAMBADA file is built from the
one-process model's greedy predictions, so some answers are right.
"""

from __future__ import annotations

import pytest
import torch

from tests import zeroshot_data
from tests.dist_utils import run_distributed

SEQ = 32


def model_flags(tok_flags: list[str]) -> list[str]:
    # Vocabulary 512 padded to 768 at tp 1 and 2: tp rank 1 holds real and padding ids.
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
            "--make-vocab-size-divisible-by", "384", "--init-method-std", "0.3",
            "--seed", "5", "--micro-batch-size", "2", "--use-cpu", *tok_flags]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zeroshot-layouts")
    texts = zeroshot_data.texts(60_000)
    tok, tok_flags = zeroshot_data.train_tokenizer(texts, root / "tokenizer")
    flags = model_flags(tok_flags)
    model = _one_process_model(flags, tok.vocab_size)

    def next_token(ids: list[int]) -> int:
        with torch.no_grad():
            return model(torch.tensor([ids]))[0, -1, :tok.vocab_size].argmax().item()

    wiki, lambada = root / "wiki.valid.txt", root / "lambada.jsonl"
    zeroshot_data.write_wikitext(wiki, texts, 3_000)
    zeroshot_data.write_lambada(lambada, texts, tok, next_token, SEQ - 2, count=30)
    tasks = [["--task", "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", "8"],
             ["--task", "LAMBADA", "--valid-data", str(lambada)],
             ["--task", "LAMBADA", "--valid-data", str(lambada), "--strict-lambada"]]
    return root, flags, tasks


def _one_process_model(flags: list[str], vocab_size: int):
    from megatron.config import parse_args
    from megatron.model.gpt_model import GPTModel

    cfg = parse_args(flags, require_training=False, world_size=1).with_vocab_size(vocab_size)
    return GPTModel(cfg.model).eval()


def _save_and_evaluate(rank, world_size, flags, save_dir, tasks):
    """Save this layout's model, then evaluate each task from that checkpoint."""
    from megatron.assembly.build import build_run_tokenizer
    from megatron.assembly.initialize import initialize_megatron
    from megatron.checkpointing import save_checkpoint
    from megatron.config import parse_args
    from megatron.inference.evaluation.cli import main
    from megatron.inference.evaluation.model import _model_chunks

    cfg = parse_args(flags + ["--save", save_dir, "--save-interval", "1"],
                     require_training=False)
    device = initialize_megatron(cfg)
    cfg = cfg.with_vocab_size(build_run_tokenizer(cfg).vocab_size)
    save_checkpoint(1, _model_chunks(cfg, device), None, None, cfg, consumed_train_samples=0)
    return [main(task + flags + ["--load", save_dir]) for task in tasks]


def evaluate(world, flags, root, tasks, name):
    results = run_distributed(_save_and_evaluate, world, flags, str(root / name), tasks)
    for other in results[1:]:
        assert other == results[0]  # every rank returns the totals
    return results[0]


@pytest.fixture(scope="module")
def reference(inputs):
    root, flags, tasks = inputs
    wiki, lambada, strict = evaluate(1, flags, root, tasks, "tp1")
    assert 0 < lambada.correct < lambada.total, "the file must hold right and wrong answers"
    return wiki, lambada, strict


LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"],
           "dp2": []}  # data parallel 2: each rank evaluates half of the examples


@pytest.fixture(scope="module")
def at_layout(inputs):
    """Saves and evaluates a layout on 2 ranks once per module; returns its results."""
    root, flags, tasks = inputs
    done = {}

    def results(name: str):
        if name not in done:
            done[name] = evaluate(2, flags + LAYOUTS[name], root, tasks, name)
        return done[name]

    return results


def _assert_same(got, expected):
    (wiki, lambada, strict), (ref_wiki, ref_lambada, ref_strict) = got, expected
    assert wiki.avg_loss == pytest.approx(ref_wiki.avg_loss, rel=1e-5)
    assert wiki.adjusted_ppl == pytest.approx(ref_wiki.adjusted_ppl, rel=1e-4)
    assert wiki.token_ratio == ref_wiki.token_ratio
    assert lambada == ref_lambada
    assert strict == ref_strict


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_one_process_results(reference, at_layout, layout):
    _assert_same(at_layout(layout), reference)


def _evaluate(rank, world_size, flags, load_dir, tasks):
    from megatron.inference.evaluation.cli import main

    return [main(task + flags + ["--load", load_dir]) for task in tasks]


@pytest.mark.parametrize("saved", ["tp2", "pp2"])
def test_a_checkpoint_evaluated_in_one_process_equals_its_evaluation_at_its_layout(
        inputs, at_layout, saved):
    """The tp 2 (pp 2) checkpoint, loaded by one process (merged in memory by
    megatron.conversion), gives what its two ranks gave."""
    root, flags, tasks = inputs
    at_saved = at_layout(saved)
    one = run_distributed(_evaluate, 1, flags, str(root / saved), tasks)[0]
    _assert_same(one, at_saved)
