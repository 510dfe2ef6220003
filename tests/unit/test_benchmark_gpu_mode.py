"""benchmarks/train_throughput.py --device cuda, checked without a GPU: the peer loops run in
fp32 on CPU at a tiny shape, ours' command and log parsing are checked on text, and the driver
runs end to end with its subprocesses replaced by canned output."""

import json
import math

import pytest
import torch

from tests.distributed.training_utils import load_benchmark
from tests.shared_data import ROOT, missing, nanogpt_model

throughput = load_benchmark("train_throughput")
peers = load_benchmark("gpu_peers")


def _tiny_run(device: str = "cpu", autocast=None):
    return peers.PeerRun(layers=2, hidden=64, heads=2, seq=64, batch=2, vocab=512, iters=2,
                         warmup=1, device=device, autocast=autocast)


def _check(result: dict) -> None:
    assert result["tokens_per_s"] > 0
    assert math.isfinite(result["loss"])


@pytest.mark.shared_data
def test_nanogpt_loop_on_cpu():
    path = nanogpt_model()
    if path is None:
        pytest.skip(missing(ROOT / "peers/nanogpt/model.py", also=", or $NANOGPT_MODEL to "
                            "nanoGPT's model.py"))
    result = peers.nanogpt_loop(_tiny_run(), str(path))
    _check(result)
    assert result["peak_memory_mb"] is None  # CPU: no CUDA allocator to ask


def test_hf_loop_on_cpu_through_the_worker_cli(capsys):
    peers.main(["hf", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64",
                "--batch", "2", "--vocab", "512", "--iters", "2", "--warmup", "1",
                "--device", "cpu", "--autocast", "none"])
    _check(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))


def test_matmul_peak_runs_on_cpu():
    assert peers.matmul_peak_tflops(sizes=(32,), repeats=2, calls=2, device="cpu")["tflops"] > 0


@pytest.mark.gpu
def test_peers_in_bf16_on_cuda():
    _check(peers.hf_loop(_tiny_run("cuda", "bfloat16")))
    path = nanogpt_model()
    if path is not None:
        result = peers.nanogpt_loop(_tiny_run("cuda", "bfloat16"), str(path))
        _check(result)
        assert result["peak_memory_mb"] > 0


def test_ours_gpu_command():
    shape = throughput.GPU_SHAPES["1.3b"]
    command = throughput.gpu_pretrain_command(shape, 23, 1.0, ("--compile",))

    def flag(name):
        return command[command.index(name) + 1]

    assert "--bf16" in command and "--use-flash-attn" in command and "--mock-data" in command
    assert (flag("--num-layers"), flag("--hidden-size"), flag("--num-attention-heads")) == (
        "24", "2048", "16")
    assert flag("--seq-length") == flag("--max-position-embeddings") == "1024"
    assert flag("--micro-batch-size") == flag("--global-batch-size") == "8"
    assert flag("--train-iters") == "23" and command[-1] == "--compile"
    # The CPU shapes keep their meaning: gpt2-124m is micro-batch 1 there, 16 on a GPU.
    assert throughput.SHAPES["gpt2-124m"].micro_batch == 1
    assert throughput.GPU_SHAPES["gpt2-124m"].micro_batch == 16


def _log_line(iteration: int, tgs: float) -> str:
    return (f" iteration {iteration:8d}/{5:8d} | consumed samples: {iteration * 8:12d} | "
            "elapsed time per iteration (ms): 120.0 | learning rate: 6.000000E-04 | "
            "global batch size:     8 | lm loss: 1.085067E+01 | loss scale: 1.0 | "
            "grad norm: 1.857 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 | tokens per GPU per second (TGS): {tgs:.1f} | "
            "TFLOP/s per GPU: 300.000 |")


def _memory_line(max_allocated: float) -> str:
    return (f"[Rank 0] (after 1 iterations) memory (MB) | allocated: 2100.5 | "
            f"max allocated: {max_allocated} | reserved: 9000.0 | max reserved: 9000.0")


def _fake_log(warmup: int, iters: int, memory: bool = True) -> str:
    lines = [_log_line(1, 10.0), *([_memory_line(8123.25)] if memory else [])]
    lines += [_log_line(i, 10.0 if i <= warmup else 4000.0) for i in range(2, warmup + iters + 1)]
    return "\n".join(lines) + "\n"


def test_log_parsing():
    log = _fake_log(warmup=2, iters=3)
    assert throughput.tokens_per_second_from_log(log, 2, 8 * 1024) == pytest.approx(4000.0)
    assert throughput.max_allocated_from_log(log) == 8123.25
    assert throughput.max_allocated_from_log(_fake_log(2, 3, memory=False)) is None


def test_gpu_driver_end_to_end_with_canned_runs(monkeypatch, capsys, tmp_path):
    """main --device cuda on CPU: every subprocess answers from here; HF fails once."""
    calls = []

    def fake_run_logged(command, timeout=None, env=None):
        calls.append(command)
        if command[1] != throughput.PEERS:  # ours
            return _fake_log(warmup=3, iters=2, memory=len(calls) > 2)
        if command[2] == "matmul-peak":
            return json.dumps({"tflops": 700.0 + len(calls), "device_name": "Fake GPU"})
        if command[2] == "hf" and len(calls) < 8:
            raise RuntimeError("CUDA out of memory")
        rate = {"nanogpt": 3000.0, "nanogpt-compile": 3500.0, "hf": 2000.0}[command[2]]
        return "warm-up chatter\n" + json.dumps({"tokens_per_s": rate, "loss": 10.8,
                                                 "peak_memory_mb": 9000.0})

    monkeypatch.setattr(throughput, "run_logged", fake_run_logged)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NANOGPT_MODEL", __file__)  # any file: nanoGPT's runs are canned
    written = []
    write_json = throughput.write_json
    monkeypatch.setattr(throughput, "write_json",
                        lambda path, record: written.append(record) or write_json(path, record))
    throughput.main(["--device", "cuda", "--shapes", "gpt2-124m", "1.3b", "--rounds", "2",
                     "--iters", "2", "--json", str(tmp_path / "figures.json"),
                     "--ours-args", "--foo"])
    out = capsys.readouterr().out
    ours = [c for c in calls if c[1].endswith("pretrain_gpt.py")]
    assert len(ours) == 8 and all("--foo" in c and "--bf16" in c for c in ours)
    compiled = [c for c in ours if c[-1] == "--compile"]
    assert len(compiled) == 4 and all(c[-2] == "--foo" for c in compiled)
    assert "Fake GPU" in out and "bf16 matmul peak" in out
    assert "| gpt2-124m | ours | 4000 |" in out and "| 1.3b | nanogpt-compile | 3500 |" in out
    assert "| 1.3b | ours-compile | 4000 |" in out
    # Two of three shapes measured; 4000 / 3500 by the first of the equally fast variants.
    assert "not measured at all three shapes (gpt2-124m 1.143 by ours, 1.3b 1.143 by ours)" in out
    assert "hf, round 1, failed" in out
    assert "| 8123 | 1.000 |" in out  # the first run printed no memory line
    assert "ours >= 1.1x nanoGPT+compile at all three shapes: not measured" in out
    assert "ours >= 60% MFU at 1.3b: not met" in out
    # --json: rewritten after each of the 20 runs, then once complete.
    assert len(written) == 21 and [r["complete"] for r in written[-2:]] == [False, True]
    assert written[0]["shapes"]["gpt2-124m"]["contenders"]["ours"]["tokens_per_s"] == 4000.0
    assert written[0]["shapes"]["gpt2-124m"]["contenders"]["hf"]["tokens_per_s"] is None
    final = json.loads((tmp_path / "figures.json").read_text())
    assert final == json.loads(json.dumps(written[-1]))
    assert final["shapes"]["1.3b"]["contenders"]["nanogpt-compile"]["tokens_per_s"] == 3500.0
    assert final["goal"]["mfu_check"] == "not met" and final["peak_tflops"] > 700
