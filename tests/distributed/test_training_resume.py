"""Stopping and resuming training changes nothing.

20 iterations straight equal 10 iterations, a checkpoint, and 10 more from it, bit for bit on
CPU fp32 (with dropout, so the random generators must resume too): losses, grad norms,
learning rates, consumed samples, iteration numbers, validation losses, and the order of the
training and validation samples. Shown for one process, two data-parallel ranks with the
distributed optimizer, and tensor parallelism 2. The exits (--exit-interval,
--exit-duration-in-mins, SIGTERM with --exit-signal-handler) each leave a checkpoint that
training resumes from, and a save killed half-way leaves the previous checkpoint the latest.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from megatron.checkpointing import list_iterations, read_tracker
from megatron.core import parallel_state
from megatron.training import pretrain
from tests.dist_utils import run_distributed
from tests.distributed.training_utils import (
    RecordingIterator,
    base_argv,
    build_small_corpus,
    captured_stdout,
    parse_log_lines,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 20
RESUME_FLAGS = {"--train-iters": ITERS, "--hidden-dropout": 0.1, "--attention-dropout": 0.1,
                "--eval-interval": 5, "--eval-iters": 1, "--split": "90,10,0"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("corpus")))


class Recorder:
    """pretrain_gpt's forward_step, noting a hash of every micro-batch it reads (train and
    validation alike, in the order the loop asks for them)."""

    def __init__(self) -> None:
        self.samples: list[str] = []

    def __call__(self, ctx, data_iterator, model, stage):
        return pretrain_gpt.forward_step(ctx, RecordingIterator(data_iterator, self.samples),
                                         model, stage)


def _run(argv: list[str]) -> dict:
    recorder = Recorder()
    with captured_stdout() as out:
        state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                         pretrain_gpt.model_provider, recorder, argv=argv)
    log = out.getvalue()
    return dict(
        steps=[(h["iteration"], h["losses"]["lm loss"], h["grad_norm"]) for h in state.history],
        iteration=state.iteration, consumed=state.consumed_train_samples,
        consumed_valid=state.consumed_valid_samples, samples=recorder.samples, log=log,
        lines=[(line["iteration"], line["consumed samples"], line["learning rate"],
                line["lm loss"]) for line in parse_log_lines(log)],
        validation=re.findall(r"validation loss at iteration (\d+) \| lm loss value: (\S+)", log))


def _straight_and_resumed(corpus, cache, save, flags):
    argv = base_argv(corpus, cache, **{**RESUME_FLAGS, **flags})
    straight = _run(argv)
    # The first half saves at 7 (--save-interval) and 10 (the exit), the second loads 10.
    checkpointing = ["--save", save, "--save-interval", "7"]
    first = _run(argv + checkpointing + ["--exit-interval", "10"])
    second = _run(argv + checkpointing + ["--load", save])
    return straight, first, second


def _duration_exit(argv):
    """pretrain() with the loop's clock jumping 61 s ahead during iteration 3."""
    from megatron.training import loop as training

    class Clock:
        offset = 0.0
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def time():
            return time.time() + Clock.offset

    def forward_step(ctx, data_iterator, model, stage):
        calls.append(1)
        if len(calls) == 3 * 2:  # the last micro-batch of iteration 3
            Clock.offset = 61.0
        return pretrain_gpt.forward_step(ctx, data_iterator, model, stage)

    calls: list = []
    real_time, training.time = training.time, Clock
    try:
        with captured_stdout() as out:
            state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                             pretrain_gpt.model_provider, forward_step, argv=argv)
    finally:
        training.time = real_time
    return state.iteration, out.getvalue()


LAYOUTS = {1: {"single": {}},
           2: {"dp2-distopt": {"--use-distributed-optimizer": True},
               "tp2": {"--tensor-model-parallel-size": 2}}}


def _all_runs(rank, world_size, corpus, folder):
    # Every run of one world size in one set of processes: start-up costs more than the runs.
    results = {}
    for name, flags in LAYOUTS[world_size].items():
        parallel_state.destroy_model_parallel()  # the next pretrain() makes its own groups
        results[name] = _straight_and_resumed(corpus, f"{folder}/cache",
                                              f"{folder}/{name}", flags)
    if world_size == 1:
        argv = base_argv(corpus, f"{folder}/cache", **{
            "--exit-duration-in-mins": 1, "--save": f"{folder}/duration",
            "--save-interval": 1000})
        results["duration"] = _duration_exit(argv)
    return results


def _spawn(world_size, corpus, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"world{world_size}"))
    return folder, run_distributed(_all_runs, world_size, corpus, folder)


@pytest.fixture(scope="module")
def world1(corpus, tmp_path_factory):
    return _spawn(1, corpus, tmp_path_factory)


@pytest.fixture(scope="module")
def world2(corpus, tmp_path_factory):
    return _spawn(2, corpus, tmp_path_factory)


def _layout_results(runs, name):
    folder, ranks = runs
    return f"{folder}/{name}", [r[name] for r in ranks]


@pytest.mark.parametrize("name,world", [
    ("single", "world1"), ("dp2-distopt", "world2"), ("tp2", "world2")])
def test_resume_continues_bit_for_bit(request, name, world):
    save, ranks = _layout_results(request.getfixturevalue(world), name)
    straight, first, second = ranks[0]
    assert "exiting at iteration 10 (--exit-interval reached); checkpoint saved" in first["log"]
    assert list_iterations(save) == [7, 10, 14, 20]
    assert "training from iteration 10 to 20" in second["log"]

    assert [s[0] for s in first["steps"]] == list(range(1, 11))
    assert [s[0] for s in second["steps"]] == list(range(11, 21))
    assert first["steps"] + second["steps"] == straight["steps"]  # exact, not approximate
    assert first["lines"] + second["lines"] == straight["lines"]  # LR, consumed samples
    assert first["validation"] + second["validation"] == straight["validation"]
    assert len(straight["validation"]) == 4
    assert first["samples"] + second["samples"] == straight["samples"]  # data order
    gbs = 4
    assert (first["consumed"], second["consumed"], straight["consumed"]) == \
        (10 * gbs, ITERS * gbs, ITERS * gbs)
    assert second["consumed_valid"] == straight["consumed_valid"] == 4 * gbs
    # Dropout was on: without the saved generators the second half would differ.
    assert len({loss for _, loss, _ in straight["steps"]}) == ITERS
    for other in ranks[1:]:  # every rank saw the same reduced numbers
        assert [r["steps"] for r in other] == [r["steps"] for r in ranks[0]]


def test_exit_duration_saves_and_exits(world1):
    save, ranks = _layout_results(world1, "duration")
    iteration, log = ranks[0]
    assert iteration == 3
    assert "exiting at iteration 3 (--exit-duration-in-mins reached); checkpoint saved" in log
    assert read_tracker(save).iteration == 3 and list_iterations(save) == [3]


# The real CLI as a subprocess: signals and kills ------------------------------------------


def _cli(corpus, tmp_path, **flags) -> list[str]:
    argv = base_argv(corpus, str(tmp_path / "cache"), **{"--lr-decay-iters": 1000, **flags})
    return [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv]


def _cli_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _start(cmd) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_cli_env(), cwd=REPO)


def _resume_for(corpus, tmp_path, save: str, iterations: int, **flags) -> str:
    """Run the CLI with --load for ``iterations`` more iterations; returns its output."""
    start = read_tracker(save).iteration
    cmd = _cli(corpus, tmp_path, **{"--load": save, "--exit-interval": start + iterations,
                                    **flags})
    done = subprocess.run(cmd, capture_output=True, text=True, env=_cli_env(), cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"training from iteration {start} to " in done.stdout
    lines = parse_log_lines(done.stdout)
    assert [line["iteration"] for line in lines] == list(range(start + 1,
                                                               start + iterations + 1))
    return done.stdout


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    # No --use-cpu: on a machine with a GPU this runs there, over NCCL (its flag and
    # counter collectives once failed there on CPU tensors).
    proc = _start(_cli(corpus, tmp_path, **{"--train-iters": 100_000, "--save": save,
                                            "--save-interval": 100_000,
                                            "--exit-signal-handler": True, "--use-cpu": None}))
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith(" iteration "):
                proc.send_signal(signal.SIGTERM)
                break
        output += proc.stdout.readlines()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(output)
    assert proc.returncode == 0, text[-3000:]
    found = re.search(r"exiting at iteration (\d+) \(SIGTERM received with "
                      r"--exit-signal-handler\); checkpoint saved", text)
    assert found, text[-3000:]
    iteration = int(found.group(1))
    assert iteration >= 1 and read_tracker(save).iteration == iteration
    _resume_for(corpus, tmp_path, save, 2, **{"--train-iters": 100_000})


BIG_MODEL = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8,
             "--micro-batch-size": 1, "--global-batch-size": 1}  # ~150 MB per checkpoint


def _wait_for(predicate, proc, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"training exited early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.001)
    raise AssertionError("timed out waiting for a checkpoint")


def _partial_file(save: str, full_size: int):
    """The model file of an unfinished save, while it is less than half written."""
    for d in os.listdir(save):
        path = os.path.join(save, d, "mp_rank_00", "model_optim_rng.pt")
        try:
            if ".tmp-" in d and 0 < os.path.getsize(path) < full_size // 2:
                return path
        except OSError:
            pass
    return None


def test_save_killed_half_way_leaves_the_previous_checkpoint(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    proc = _start(_cli(corpus, tmp_path, **BIG_MODEL, **{
        "--train-iters": 100, "--save": save, "--save-interval": 1}))
    try:
        _wait_for(lambda: (read_tracker(save) or (0,))[0] >= 1, proc, timeout=120)
        first = read_tracker(save).iteration
        full = os.path.getsize(os.path.join(save, f"iter_{first:07d}", "mp_rank_00",
                                            "model_optim_rng.pt"))
        partial = _wait_for(lambda: _partial_file(save, full), proc, timeout=60)
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    if not os.path.exists(partial):
        pytest.skip("the save finished between the size check and the kill")
    killed_at = int(re.search(r"iter_(\d+)\.tmp-", partial).group(1))
    previous = read_tracker(save).iteration
    assert previous == killed_at - 1 >= first
    # The half-written folder is not a checkpoint; the previous one loads and training goes on.
    assert list_iterations(save)[-1] == previous
    _resume_for(corpus, tmp_path, save, 1, **BIG_MODEL, **{"--train-iters": 100,
                                                            "--save": save,
                                                            "--save-interval": 1000})
    assert read_tracker(save).iteration == previous + 1
    # ... and that save removed the killed save's temporary folder.
    assert not os.path.exists(os.path.dirname(os.path.dirname(partial)))
