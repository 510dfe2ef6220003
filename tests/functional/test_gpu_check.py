"""benchmarks/gpu_check.py, the prepared GPU check, proven without a GPU.

- a command past its time limit is stopped with everything it started;
- a step past its limit is recorded as timed out and the next step still runs; the three
  result files are written and the summary is printed last;
- --prepare copies what the GPU machine needs, checked against SHA256SUMS, and refuses a
  missing or altered file with one ``error:`` line;
- --dry-run, after --prepare, runs every step's plumbing on the CPU (the throughput step at one
  shape) with deepspeed, nltk and the other packages the GPU machine lacks made unimportable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import shared_data
from tests.processes import alive

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
# Absent on the GPU machine (issue 21): nothing the check runs may need them.
ABSENT_THERE = ("deepspeed", "nltk", "tomli_w", "flask", "wandb", "datasets", "apex",
                "flash_attn")


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    spec.loader.exec_module(module)
    return module


def test_a_command_past_its_limit_is_stopped_with_its_children(gpu_check, tmp_path):
    from time_limit import run_with_time_limit

    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    start = time.monotonic()
    assert run_with_time_limit(["sh", "-c", script], 1.0) is None
    assert time.monotonic() - start < 10
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not alive(child)
    assert run_with_time_limit(["sh", "-c", "exit 3"], 10.0) == 3


PARTIAL = {"dry_run": False, "complete": False,
           "shapes": {"gpt2-124m": {"contenders": {
               "ours": {"tokens_per_s": 300000.0, "mfu": 0.3, "memory_mb": 9000.0},
               "ours-compile": {"tokens_per_s": None, "mfu": None, "memory_mb": None}}}},
           "goal": {"ratios": {"gpt2-124m": None}, "used": {"gpt2-124m": "ours"}}}


def _fake_worker(step: str, work: Path) -> list[str]:
    """A step that hangs (env), one that passes (smoke), one that fails a check (generate),
    one that writes partial figures and hangs (throughput-124m)."""
    if step == "env":
        return [sys.executable, "-c", "import time; print('hanging', flush=True); time.sleep(60)"]
    if step == "throughput-124m":
        partial = str(work / f"{step}.figures.json")
        return [sys.executable, "-c", f"import time; open({partial!r}, 'w').write("
                f"{json.dumps(PARTIAL)!r}); time.sleep(60)"]
    checks = [["it ran", True, ""]] + ([["it is fast", False, "slow"]] if step == "generate"
                                       else [])
    report = json.dumps({"checks": checks, "figures": {"answer": 42}})
    return [sys.executable, "-c",
            f"open({str(work / (step + '.json'))!r}, 'w').write({report!r}); print('ran')"]


def test_steps_run_in_order_under_their_limits(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "worker_command",
                        lambda step, args, work, peak: _fake_worker(step, work))
    out = tmp_path / "out"
    status = gpu_check.main(["--steps", "env", "smoke", "generate", "throughput-124m",
                             "--limit", "env=1", "throughput-124m=2", "--out", str(out)])
    assert status == 1
    record = json.loads((out / gpu_check.FIGURES).read_text())
    steps = {s["name"]: s for s in record["steps"]}
    assert list(steps) == ["env", "smoke", "generate", "throughput-124m"]
    assert steps["env"]["status"] == "timed out" and steps["env"]["limit_s"] == 1.0
    assert steps["env"]["wall_s"] < 10
    assert steps["smoke"]["status"] == "passed" and steps["smoke"]["figures"] == {"answer": 42}
    assert steps["generate"]["status"] == "failed"
    assert steps["throughput-124m"]["status"] == "timed out"
    assert steps["throughput-124m"]["figures"] == {**PARTIAL, "partial": True}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [gpu_check.LOG, gpu_check.FIGURES, gpu_check.SUMMARY])
    log = (out / gpu_check.LOG).read_text()
    assert "hanging" in log and "===== smoke: passed" in log
    printed = capsys.readouterr().out
    summary = (out / gpu_check.SUMMARY).read_text()
    assert printed.rstrip().endswith(f"{out / gpu_check.SUMMARY}")
    assert summary.strip() in printed
    assert "| env | timed out (stopped at its limit of 1 s)" in summary
    assert "- [ ] generate: it is fast (slow)" in summary
    assert "| gpt2-124m | 300,000 | n/a | n/a | n/a | n/a | n/a by ours | 30.0% | 9000 |" in summary


def test_deadline_and_flag_errors(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "worker_command",
                        lambda step, args, work, peak: _fake_worker(step, work))
    out = tmp_path / "out"
    assert gpu_check.main(["--steps", "smoke", "generate", "--deadline", "0",
                           "--out", str(out)]) == 1
    steps = json.loads((out / gpu_check.FIGURES).read_text())["steps"]
    assert [s["status"] for s in steps] == ["not run", "not run"]
    for bad in (["--limit", "smoke"], ["--limit", "nosuchstep=5"], ["--steps", "nosuchstep"]):
        with pytest.raises(SystemExit):
            gpu_check.main(bad)
    assert "--limit smoke: expected STEP=SECONDS" in capsys.readouterr().err


def _fake_shared(root: Path, files: tuple[str, ...]) -> Path:
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"contents of {rel}\n")
    sums = "".join(f"{hashlib.sha256((root / rel).read_bytes()).hexdigest()}  "
                   f"{rel.removeprefix('data/')}\n" for rel in files if rel.startswith("data/"))
    (root / "data" / "SHA256SUMS").write_text(sums)
    return root


def test_prepare_copies_checks_and_refuses(gpu_check, tmp_path, capsys):
    shared = _fake_shared(tmp_path / "shared", gpu_check.INPUT_FILES)
    dest = tmp_path / "inputs"
    assert gpu_check.main(["--prepare", "--shared", str(shared), "--inputs", str(dest)]) == 0
    for rel in gpu_check.INPUT_FILES:
        assert (dest / rel).read_bytes() == (shared / rel).read_bytes()
    record = json.loads((dest / "prepared.json").read_text())
    assert set(record["files"]) == set(gpu_check.INPUT_FILES) and "commit" in record
    assert not list(dest.rglob("*.tmp"))

    (shared / "data/wikitext-2/valid.txt").write_text("altered\n")
    assert gpu_check.main(["--prepare", "--shared", str(shared), "--inputs", str(dest)]) == 2
    (shared / "peers/nanogpt/model.py").unlink()
    assert gpu_check.main(["--prepare", "--shared", str(shared), "--inputs", str(dest)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"error: {shared}/data/wikitext-2/valid.txt: SHA-256 differs from "
                      f"{shared}/data/SHA256SUMS")
    assert err[1].startswith(f"error: {shared}/peers/nanogpt/model.py: not found")


BLOCKER = f"""
import importlib.machinery

# Test stand-in for the GPU machine, which lacks these packages (issue 21).
_ABSENT = {set(ABSENT_THERE)!r}
_find_spec = importlib.machinery.PathFinder.find_spec.__func__


def _without_absent(cls, fullname, path=None, target=None):
    if fullname.split(".")[0] in _ABSENT:
        return None
    return _find_spec(cls, fullname, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(_without_absent)
"""


@pytest.mark.slow
@pytest.mark.shared_data
def test_dry_run_runs_every_step_without_the_packages_the_gpu_machine_lacks(tmp_path):
    needed = [shared_data.ROOT / name for name in ("data/wikitext-2/valid.txt",
                                                   "peers/nanogpt/model.py")]
    if not all(path.is_file() for path in needed):
        pytest.skip(shared_data.missing(*needed) + ": the check prepares from them")
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}
    env.pop("OUT", None)
    for name in ABSENT_THERE[:2]:  # the stand-in works
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], env=env,
                               capture_output=True, text=True)
        assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    script = str(BENCHMARKS / "gpu_check.py")
    subprocess.run([sys.executable, script, "--prepare", "--shared", str(shared_data.ROOT),
                    "--inputs", str(inputs)], env=env, check=True, cwd=REPO, timeout=60)
    done = subprocess.run([sys.executable, script, "--dry-run", "--inputs", str(inputs),
                           "--skip", "throughput-350m", "throughput-1.3b", "--out", str(out)],
                          env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    log = (out / "gpu-check.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + log[-5000:]
    record = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in record["steps"]}
    assert list(steps) == ["env", "gpu-tests", "cpu-tests", "smoke", "generate", "llama-1b",
                           "moe", "throughput-124m"]
    assert all(s["status"] == "passed" for s in steps.values())
    assert steps["env"]["limit_s"] == 3 * 45  # a dry run's limits have slack
    assert steps["env"]["figures"]["inputs"]["data"] == str(inputs / "data")
    smoke = steps["smoke"]["figures"]
    assert len(smoke["losses"]) == 30 and smoke["losses"][-1] < smoke["losses"][0] - 1
    assert smoke["flash_attn_fallback_line"]
    llama = steps["llama-1b"]["figures"]
    assert len(llama["losses"]) == 5 and llama["tokens_per_s"] > 0
    moe = steps["moe"]["figures"]
    assert len(moe["losses"]) == 5 and moe["tokens_per_s"] > 0
    contenders = steps["throughput-124m"]["figures"]["shapes"]["gpt2-124m"]["contenders"]
    assert set(contenders) == {"ours", "ours-compile", "nanogpt", "nanogpt-compile", "hf"}
    assert all(c["tokens_per_s"] > 0 for c in contenders.values())
    summary = (out / "gpu-check-summary.md").read_text()
    assert done.stdout.rstrip().endswith("gpu-check-summary.md")
    assert summary.strip() in done.stdout
    assert "| gpt2-124m |" in summary and "| 8 | ours (KV cache) |" in summary
    assert "No module named 'deepspeed'" not in log and "No module named 'nltk'" not in log


def test_readme_gives_the_steps_and_the_call_as_they_are(gpu_check):
    """README's GPU check section: each step's plan and limit as in STEPS, the exact call."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### The GPU check"):]
    section = section[:section.index("\n## ")]
    for step in gpu_check.STEPS:
        if step.name.startswith("throughput"):
            continue
        row = next(line for line in section.splitlines() if line.startswith(f"| `{step.name}`"))
        assert row.endswith(f"| {step.planned_s:.0f} s | {step.limit_s:.0f} s |"), row
    throughput = [s for s in gpu_check.STEPS if s.name.startswith("throughput")]
    planned = ", ".join(f"{s.planned_s:.0f}" for s in throughput)
    limits = ", ".join(f"{s.limit_s:.0f}" for s in throughput)
    assert f"| {planned} s | {limits} s |" in section
    assert f"No step starts after {gpu_check.DEADLINE_S:.0f} s" in section
    assert "\n       PYTHONPATH=. python3 benchmarks/gpu_check.py\n" in section
    assert "\n       python benchmarks/gpu_check.py --prepare\n" in section
    assert f"`{gpu_check.INPUTS.name}/`" in section
    assert f"/{gpu_check.INPUTS.name}/" in (REPO / ".gitignore").read_text().splitlines()


def test_the_gpu_scale_commands_are_valid_training_flags(gpu_check):
    """What only the GPU machine runs (124M smoke runs, the throughput shapes) parses into
    a valid configuration here, so the first GPU call does not fail on a flag."""
    import gpu_check_steps as steps
    import train_throughput

    from megatron.config import parse_args

    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"]
    runs = [steps.smoke_command(steps.GPU, data, *extra) for extra in (
        (), ("--save", "ckpt", "--save-interval", "15", "--exit-interval", "15"),
        ("--load", "ckpt"), ("--use-flash-attn",))]
    runs += [train_throughput.gpu_pretrain_command(shape, 13, 1.0, ("--compile",))
             for shape in train_throughput.GPU_SHAPES.values()]
    for command in runs:
        assert command[1].endswith("pretrain_gpt.py")
        config = parse_args(command[2:])
        assert config.model.num_layers in (12, 24) and config.model.seq_length == 1024
    llama = parse_args(steps.llama_command(steps.GPU)[2:])
    assert (llama.model.num_layers, llama.model.hidden_size, llama.model.query_groups,
            llama.model.ffn_hidden_size, llama.model.swiglu) == (16, 2048, 8, 8192, True)
    smoke = parse_args(runs[0][2:])
    assert smoke.model.hidden_size == 768 and smoke.training.train_iters == 30
    assert smoke.training.deterministic_mode and smoke.model.params_dtype == torch.bfloat16


def test_pytest_closing_lines_are_counted(gpu_check):
    from gpu_check_steps import pytest_counts

    quiet = "PASSED tests/gpu/a.py::t\n3 passed, 1 failed, 2 skipped, 2 errors in 4.20s\n"
    assert pytest_counts(quiet) == {"passed": 3, "failed": 1, "skipped": 2, "error": 2}
    framed = "===== 13 skipped, 1 error in 7.1s =====\n"
    assert pytest_counts(framed) == {"skipped": 13, "error": 1}
    assert pytest_counts("ImportError while loading conftest\n") == {}
