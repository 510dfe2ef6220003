"""pretrain_gpt.py --eval-only: the validation and test loss of a loaded checkpoint, printed in
Megatron's evaluation lines, equal to those the training run printed for the same batches;
no training step and nothing written to the checkpoint folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.distributed.training_utils import base_argv, build_small_corpus, parse_log_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("corpus")))


def _run(argv: list[str], script: str = "pretrain_gpt.py") -> subprocess.CompletedProcess:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, os.path.join(REPO, script), *argv],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


def _losses(stdout: str, prefix: str) -> list[float]:
    return [float(v) for v in re.findall(re.escape(prefix) + r" \| lm loss value: (\S+) \| "
                                         r"lm loss PPL: \S+", stdout)]


def _snapshot(folder) -> dict:
    return {os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
            for root, _, names in os.walk(folder) for name in names}


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A 4-iteration run that saved its checkpoint: (its flags, the folder, its stdout).
    --save without --save-interval: saved once, at the end (as in Megatron)."""
    root = tmp_path_factory.mktemp("trained")
    ckpt = str(root / "ckpt")
    argv = base_argv(corpus, str(root / "cache"), **{
        "--train-iters": 4, "--eval-iters": 2, "--split": "90,5,5", "--save": ckpt})
    done = _run(argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return argv, ckpt, done


def test_save_without_save_interval_saves_once_at_the_end(trained):
    from megatron.checkpointing import list_iterations

    _, ckpt, done = trained
    assert list_iterations(ckpt) == [4]
    assert "last checkpoint" in done.stdout and "iter_0000004" in done.stdout.split(
        "run summary")[-1]


def test_eval_only_prints_the_checkpoints_losses_and_writes_nothing(trained):
    argv, ckpt, trained = trained
    valid = _losses(trained.stdout, "validation loss at the end of training (iteration 4)")
    test = _losses(trained.stdout, "test loss at the end of training (iteration 4)")
    assert len(valid) == len(test) == 1, trained.stdout[-3000:]
    before = _snapshot(ckpt)

    # The training command with --eval-only: --save stays, and is not written to.
    done = _run(argv + ["--load", ckpt, "--eval-only"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert parse_log_lines(done.stdout) == []  # no training iteration
    assert "run summary" not in done.stdout
    # The same batches (the checkpoint's validation position) give the same losses.
    assert _losses(done.stdout, "validation loss at iteration 4 on validation set") == \
        pytest.approx(valid, rel=1e-6)
    assert _losses(done.stdout, "validation loss at iteration 4 on test set") == \
        pytest.approx(test, rel=1e-6)
    assert _snapshot(ckpt) == before


def test_eval_only_loads_a_model_only_checkpoint_as_it_is(trained, tmp_path):
    """The converter's torch_dist output holds the model alone: --eval-only needs nothing
    else, so it evaluates it without --no-load-optim/--no-load-rng, with the same losses."""
    argv, ckpt, trained = trained
    core = str(tmp_path / "core")
    converted = _run(["--model-type", "GPT", "--loader", "megatron", "--saver", "core",
                      "--load-dir", ckpt, "--save-dir", core], "tools/checkpoint/convert.py")
    assert converted.returncode == 0, converted.stderr[-3000:]
    done = _run(argv + ["--load", core, "--eval-only"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restored: model; not read (--eval-only): optimizer state, LR schedule, RNG state" \
        in done.stdout
    valid = _losses(trained.stdout, "validation loss at the end of training (iteration 4)")
    assert _losses(done.stdout, "validation loss at iteration 4 on validation set") == \
        pytest.approx(valid, rel=1e-6)


def test_eval_only_without_a_checkpoint_is_refused(corpus, tmp_path, capsys):
    import pretrain_gpt

    argv = base_argv(corpus, str(tmp_path / "cache"), **{"--eval-iters": 2})
    with pytest.raises(SystemExit) as exit_info:  # at parse time: no process group yet
        pretrain_gpt.main(argv + ["--eval-only"])
    assert exit_info.value.code == 2
    assert "--eval-only evaluates a checkpoint: give --load" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    done = _run(argv + ["--eval-only", "--load", str(empty)])
    assert done.returncode == 1
    assert "no checkpoint in --load" in done.stderr


def test_tools_evaluate_takes_model_tokenizer_and_layout_from_the_checkpoint(
        corpus, trained, tmp_path):
    from megatron.inference.evaluation.friendly import task_argv

    argv, ckpt, _ = trained
    vocab = argv[argv.index("--vocab-file") + 1]
    wiki = tmp_path / "wiki.txt"
    wiki.write_text("The tower is 30 metres high . It was built in 1850 .\n" * 20)
    flags = task_argv(["wikitext", str(wiki), "--load", ckpt, "--use-cpu"])
    assert flags[flags.index("--vocab-file") + 1] == vocab
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "1"
    assert "--use-checkpoint-args" in flags
    done = _run(["wikitext", str(wiki), "--load", ckpt, "--use-cpu"], "tools/evaluate.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^ validation results on WIKITEXT103 \| avg loss: \S+ \| ppl: ",
                     done.stdout, re.M), done.stdout[-2000:]
