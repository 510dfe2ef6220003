"""pretrain_gpt.py on XLA devices (torch_xla's CPU client, ``PJRT_DEVICE=CPU``), issue 26.

One XLA device trains 10 fp32 iterations to the CPU run's losses within 1e-4 and compiles no
new graph once its step has run twice; data parallelism over 2 XLA devices (SPMD in one
process, ``CPU_NUM_DEVICES=2``) gives the one device's losses at the same global batch
within 1e-4, each micro-batch split over the devices, with the same graph counts and its
tokens per second per device; a checkpoint saved on XLA resumes there bit for bit and
continues on the CPU within 1e-4, and the CPU's checkpoint continues on 2 XLA devices the
same way. The seed's workflow at toy size on 2 XLA devices: FineWeb-style .npy token files,
``run_pretrain_xla.py --mp-start-method spawn --use-syncfree-optim --bf16``, then sampling
from the checkpoint with tools/generate_text.py on the CPU. Every run is a subprocess (a
fresh runtime), in the environment the tests run in (CI's torch 2.9 + torch_xla 2.9).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.training_utils import LLAMA_FLAGS, flags_to_argv

pytestmark = [pytest.mark.xla, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "distributed" / "pretrain_recorded.py"
TINY = {
    "--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4, "--seq-length": 32,
    "--max-position-embeddings": 32, "--micro-batch-size": 2, "--global-batch-size": 4,
    "--train-iters": 10, "--lr": 3e-3, "--min-lr": 3e-4, "--lr-warmup-iters": 2,
    "--lr-decay-style": "cosine", "--clip-grad": 1.0, "--hidden-dropout": 0.0,
    "--attention-dropout": 0.0, "--log-interval": 1, "--eval-interval": 5, "--eval-iters": 1,
    "--num-workers": 0, "--seed": 1234, "--mock-data": True, "--vocab-size": 128,
    "--save-interval": 5,
}


def _env(on_xla: bool, devices: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "RANK", "WORLD_SIZE", "MASTER_PORT",
                        "XLA_FLAGS")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    if on_xla:
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    return env


def _run(script, argv: list[str], on_xla: bool, timeout: int = 600, check: bool = True,
         devices: int = 1, **extra_env) -> subprocess.CompletedProcess:
    env = {**_env(on_xla, devices), **extra_env}
    result = subprocess.run([sys.executable, str(script), *argv], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _train(tmp: Path, name: str, on_xla: bool, load: Path | None = None, devices: int = 1,
           flags: dict | None = None, **extra_env) -> dict:
    """A recorded run of TINY (with ``flags`` beside): its history (exact floats) and its
    log."""
    history = tmp / f"{name}-history"
    history.mkdir()
    # The plain command: on XLA the NaN check picks the sync-free optimizer by itself.
    run_flags = {**TINY, **(flags or {}), "--save": tmp / f"{name}-ckpt", "--load": load}
    result = _run(RECORDED, flags_to_argv(run_flags), on_xla, devices=devices,
                  MEGATRON_TEST_HISTORY=str(history), **extra_env)
    return {"history": json.loads((history / "rank0.json").read_text()),
            "log": result.stdout, "save": tmp / f"{name}-ckpt"}


def _at_iteration(save: Path, iteration: int, tmp: Path, name: str) -> Path:
    """A copy of ``save`` whose latest checkpoint is ``iteration`` (its tracker file says so)."""
    copy = tmp / name
    shutil.copytree(save, copy)
    (copy / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return copy


def _losses(run: dict) -> list[float]:
    return [h["losses"]["lm loss"] for h in run["history"]]


def _validation(run: dict) -> list[str]:
    return re.findall(r"validation loss at iteration (\d+) \| lm loss value: (\S+)", run["log"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xla_runs")
    xla = _train(tmp, "xla", on_xla=True)
    cpu = _train(tmp, "cpu", on_xla=False)
    # The first graph XLA compiles (iteration 1's step), as handed to the compiler.
    dump = tmp / "dp2-hlo"
    hlo_flags = f"--xla_dump_to={dump} --xla_dump_max_hlo_modules=1 --xla_dump_hlo_as_text"
    return {
        "xla": xla, "cpu": cpu,
        "xla_dp2": {**_train(tmp, "xla_dp2", True, devices=2, XLA_FLAGS=hlo_flags),
                    "hlo": dump},
        "xla_resumed": _train(tmp, "xla_resumed", True,
                              load=_at_iteration(xla["save"], 5, tmp, "xla5")),
        "cpu_from_xla": _train(tmp, "cpu_from_xla", False,
                               load=_at_iteration(xla["save"], 5, tmp, "xla5-for-cpu")),
        "xla_dp2_from_cpu": _train(tmp, "xla_dp2_from_cpu", True, devices=2,
                                   load=_at_iteration(cpu["save"], 5, tmp, "cpu5")),
        # The Llama family's options (RMSNorm, SwiGLU, grouped-query attention, RoPE, untied)
        # over two XLA devices, against the CPU.
        "xla_dp2_llama": _train(tmp, "xla_dp2_llama", True, devices=2, flags=LLAMA_FLAGS),
        "cpu_llama": _train(tmp, "cpu_llama", False, flags=LLAMA_FLAGS),
    }


def test_the_llama_family_on_two_xla_devices_gives_the_cpu_losses(runs):
    xla, cpu = runs["xla_dp2_llama"], runs["cpu_llama"]
    assert "XLA SPMD over 2 device(s)" in xla["log"]
    assert np.allclose(_losses(xla), _losses(cpu), rtol=0, atol=1e-4), \
        (_losses(xla), _losses(cpu))
    assert _losses(cpu) != _losses(runs["cpu"])


def test_fp32_on_one_xla_device_gives_the_cpu_losses(runs):
    xla, cpu = runs["xla"], runs["cpu"]
    assert "compute device: xla:0, collectives: xla" in xla["log"]
    # The command had no --use-syncfree-optim: the default NaN check chose it, saying so once.
    assert xla["log"].count("--use-syncfree-optim chosen") == 1, xla["log"][-3000:]
    assert "--use-syncfree-optim chosen" not in cpu["log"]
    assert [h["iteration"] for h in xla["history"]] == list(range(1, 11))
    assert np.allclose(_losses(xla), _losses(cpu), rtol=0, atol=1e-4), \
        (_losses(xla), _losses(cpu))
    norms = [(h["grad_norm"], c["grad_norm"]) for h, c in zip(xla["history"], cpu["history"])]
    assert all(abs(a - b) <= 1e-4 * max(1.0, b) for a, b in norms), norms
    for (it_x, v_x), (it_c, v_c) in zip(_validation(xla), _validation(cpu)):
        assert it_x == it_c and abs(float(v_x) - float(v_c)) <= 1e-4


@pytest.mark.parametrize("name", ["xla", "xla_dp2"])
def test_no_graph_is_compiled_after_the_third_iteration(runs, name):
    counts = [h["xla_compilations"] for h in runs[name]["history"]]
    # Iterations 1 and 2 compile the step (the second has the optimizer's state); the first
    # evaluation and checkpoint (after iteration 5) compile their own graphs once.
    assert counts[2] == counts[3] == counts[4], counts
    assert len(set(counts[5:])) == 1, counts
    assert re.search(r"> XLA: \d+ graph compilations", runs[name]["log"])
    # One graph per iteration: nothing in the step is read before mark_step (iterations 2-5
    # and 7-10; the evaluation and checkpoint after iteration 5 run graphs of their own).
    runs_ = [h["xla_executions"] for h in runs[name]["history"]]
    steps = [b - a for a, b in zip(runs_, runs_[1:])]
    assert steps[:4] == [1, 1, 1, 1] and steps[5:] == [1, 1, 1, 1], runs_


def _tokens_per_device_second(log: str) -> list[tuple[float, float]]:
    """(ms per iteration, TGS) of each log line."""
    return [(float(ms), float(tgs)) for ms, tgs in re.findall(
        r"elapsed time per iteration \(ms\): (\S+) \|.*\(TGS\): (\S+) \|", log)]


def test_data_parallel_over_two_xla_devices_equals_one_device(runs):
    """SPMD in one process (CPU_NUM_DEVICES=2, the default there): Megatron's batch
    arithmetic with a data-parallel rank per device (--micro-batch-size 2 on each, the global
    batch 4 in 1 micro-batch where one device takes 2), each micro-batch split over the
    devices, the gradient reduced by XLA, the losses those of one device."""
    one, two = runs["xla"], runs["xla_dp2"]
    assert "XLA SPMD over 2 device(s)" in two["log"]
    assert re.search(r"data_parallel_size \.+ 2\n", two["log"])
    assert re.search(r"num_micro_batches \.+ 1\n", two["log"])
    assert re.search(r"num_micro_batches \.+ 2\n", one["log"])
    assert [h["iteration"] for h in two["history"]] == list(range(1, 11))
    assert np.allclose(_losses(two), _losses(one), rtol=0, atol=1e-4), \
        (_losses(two), _losses(one))
    norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(two["history"], one["history"])]
    assert all(abs(a - b) <= 1e-4 * max(1.0, b) for a, b in norms), norms
    assert len(_validation(two)) == 2
    for (it_2, v_2), (it_1, v_1) in zip(_validation(two), _validation(one)):
        assert it_2 == it_1 and abs(float(v_2) - float(v_1)) <= 1e-4
    # The graph's inputs: one is split over the 2 devices along its first dimension (the
    # micro-batch of token ids, [4, 33]), every other (parameters, optimizer state) whole.
    graph = next(runs["xla_dp2"]["hlo"].glob("*before_optimizations.txt")).read_text()
    shardings = re.findall(r"sharding=\{[^}]*\}", graph)
    assert shardings.count("sharding={devices=[2,1]0,1}") == 1, set(shardings)
    assert set(shardings) == {"sharding={devices=[2,1]0,1}", "sharding={replicated}"}
    # Tokens per second per device: the global batch's 4 x 32 tokens over the iteration's
    # time, divided by 2 devices (the printed figures are rounded).
    tokens = TINY["--global-batch-size"] * TINY["--seq-length"]
    for devices, run in ((1, one), (2, two)):
        rates = _tokens_per_device_second(run["log"])
        assert len(rates) == 10
        for ms, tgs in rates:
            assert tgs == pytest.approx(tokens / (ms / 1000) / devices, rel=0.01), (ms, tgs)


def test_checkpoint_saved_on_xla_resumes_there_bit_for_bit(runs):
    xla, resumed = runs["xla"], runs["xla_resumed"]
    assert [h["iteration"] for h in resumed["history"]] == list(range(6, 11))
    straight = [(h["losses"], h["grad_norm"]) for h in xla["history"][5:]]
    assert [(h["losses"], h["grad_norm"]) for h in resumed["history"]] == straight
    assert _validation(resumed) == _validation(xla)[1:]


def test_checkpoints_cross_between_xla_and_the_cpu(runs):
    # The files hold CPU tensors only: they load where torch_xla cannot be imported.
    saved = runs["xla"]["save"] / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    load = (f"import sys, torch; sys.modules['torch_xla'] = None; "
            f"torch.load({str(saved)!r}, weights_only=False)")
    probe = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True,
                           env=_env(False))
    assert probe.returncode == 0, probe.stderr[-2000:]
    for name, reference in (("cpu_from_xla", "xla"), ("xla_dp2_from_cpu", "cpu")):
        continued, straight = runs[name], runs[reference]
        assert [h["iteration"] for h in continued["history"]] == list(range(6, 11))
        assert np.allclose(_losses(continued), _losses(straight)[5:], rtol=0, atol=1e-4), name


def _token_files(folder: Path) -> tuple[Path, list[str]]:
    """FineWeb-style .npy shards of real text, and the tokenizer flags to read them."""
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from tests.distributed.training_utils import build_small_corpus

    corpus = build_small_corpus(str(folder / "corpus"), vocab_size=512, max_chars=60_000)
    tokens = np.concatenate(list(MMapIndexedDataset(corpus["prefix"])[:])).astype(np.uint16)
    shards = folder / "edu_fineweb10B"
    shards.mkdir()
    cut = int(0.9 * len(tokens))
    np.save(shards / "edufineweb_val_000000.npy", tokens[cut:])
    np.save(shards / "edufineweb_train_000001.npy", tokens[:cut])
    return shards, corpus["tokenizer_flags"]


def test_seed_workflow_npy_syncfree_bf16_on_two_devices_then_sampling_on_the_cpu(tmp_path):
    """The seed's command (run_pretrain_xla.py: every device of the host) on 2 XLA devices,
    which PJRT's CPU client, as TPU v2/v3, runs from one process: SPMD."""
    shards, tokenizer = _token_files(tmp_path)
    save = tmp_path / "ckpt"
    flags = {**TINY, "--mock-data": False, "--vocab-size": None, "--data-path": shards,
             "--data-impl": "npy", "--split": None, "--data-cache-path": tmp_path / "cache",
             "--train-iters": 20, "--eval-interval": 20, "--save-interval": 20,
             "--save": save, "--bf16": True, "--use-syncfree-optim": True,
             "--mp-start-method": "spawn", "--lr": 1e-2, "--make-vocab-size-divisible-by": 64}
    train = _run(REPO / "run_pretrain_xla.py", flags_to_argv(flags) + tokenizer, on_xla=True,
                 devices=2)
    losses = [float(v) for v in re.findall(r"\| lm loss: (\S+) \|", train.stdout)]
    assert len(losses) == 20 and all(np.isfinite(losses))
    assert "compute device: xla:0, XLA SPMD over 2 device(s)" in train.stdout
    assert re.search(r"data_parallel_size \.+ 2\n", train.stdout)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, losses  # bf16 learns
    sample = _run(REPO / "tools" / "generate_text.py",
                  ["--load", str(save), "--prompt", "The", "--max-new-tokens", "8",
                   "--top-k", "1", "--use-cpu"], on_xla=False)
    # One block: its header, the prompt and its new text (a tiny model's tokens may be line
    # breaks), its end line.
    from tools.generate_text import read_samples

    texts = read_samples(sample.stdout)
    assert len(texts) == 1 and texts[0].startswith("The"), sample.stdout
    assert len(texts[0]) > len("The"), sample.stdout  # new text


def test_refusals_name_the_flag():
    """End to end on a real runtime (the other refusals are unit tests, test_xla_config)."""
    cases = (
        # Two processes as torchrun starts them: PJRT's CPU client cannot join them.
        (["--use-syncfree-optim"], "2", 1, "WORLD_SIZE"),
        # 2 devices, each a data-parallel rank of --micro-batch-size 2: no global batch of 2.
        (["--use-syncfree-optim", "--global-batch-size", "2"], "1", 2,
         "XLA SPMD over 2 devices (--xla-spmd; each device is a data-parallel rank): "
         "--global-batch-size (2) is not divisible"),
        # A replica started through torch_xla.launch (--xla-processes) checks its inputs.
        (["--use-syncfree-optim", "--xla-processes", "1", "--load", str(REPO / "README.md")],
         "1", 1, "--load"),
    )
    for extra, world_size, devices, named in cases:
        flags = {**TINY, "--save": None, "--save-interval": None, "--global-batch-size": None}
        result = _run(REPO / "pretrain_gpt.py", flags_to_argv(flags) + extra, on_xla=True,
                      check=False, devices=devices, WORLD_SIZE=world_size)
        assert result.returncode == 2, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and named in last, last

