"""The steps of ``gpu_check.py``, each run in a process of its own by it
(``gpu_check.py --worker STEP``): every step prints what it runs and what that printed, and
writes ``WORK/STEP.json`` with its checks (``[name, ok, detail]``: a failed check fails the
step) and its figures.

A step's shapes come from a ``Scale``: the real one on a GPU, a tiny one on the CPU with
``--dry-run``, so that the dry run goes through the same code and commands.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GPU_TESTS = ("tests/gpu",)
# CPU-suite tests that take CUDA paths where a GPU is visible: the SIGTERM and pipeline-layout
# tests that failed on a GPU before (issue 10), the flash-attention fallback and RNG-state
# paths, the host-sync recorder, the fusion probe, and the default backend.
CPU_SUITE_TESTS = (
    "tests/distributed/test_training_resume.py::test_sigterm_saves_a_checkpoint_and_exits_cleanly",
    "tests/distributed/test_pipeline_layouts.py::test_layout_matches_one_process",
    "tests/unit/test_cuda_paths_on_cpu.py",
    "tests/unit/test_host_syncs.py",
    "tests/unit/model/test_speed_paths.py::test_mixed_accumulation_support_is_decided_per_device",
    "tests/unit/model/test_speed_paths.py::"
    "test_the_cuda_probe_runs_its_operands_and_reports_a_missing_kernel",
    "tests/unit/test_arguments.py::test_gpt2_345m_example_flags",
)
DRY_RUN_CPU_SUITE_TESTS = ("tests/unit/test_cuda_paths_on_cpu.py",
                           "tests/unit/test_arguments.py::test_gpt2_345m_example_flags")
# Packages whose versions the env step records (none is imported, so none is needed).
PACKAGES = ("torch", "triton", "numpy", "transformers", "tokenizers", "tiktoken",
            "safetensors", "regex", "tensorboard", "pytest", "flash-attn", "apex",
            "deepspeed", "nltk")


@dataclass(frozen=True)
class Scale:
    """The sizes of the steps: ``GPU`` (the issue's) or ``DRY_RUN`` (tiny, on the CPU)."""

    device: str
    peak_sizes: tuple[int, ...]
    model: tuple[str, ...]  # pretrain_gpt.py shape and batch flags of the smoke
    smoke_lr: str
    smoke_lines: Optional[int]  # WikiText lines to preprocess (None: all of valid and test)
    cpu_suite: tuple[str, ...]
    generate: tuple[str, ...]
    throughput: tuple[str, ...]  # train_throughput.py flags besides the shape
    llama: tuple[str, ...]  # pretrain_gpt.py flags of the Llama step (shape, batch, length)
    moe: tuple[str, ...]  # pretrain_gpt.py flags of the mixture-of-experts step
    contender_timeout_s: float
    pytest_workers: int  # pytest-xdist processes per test step, where xdist is installed


def _model_flags(layers: int, hidden: int, heads: int, seq: int, batch: int) -> tuple:
    return ("--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--micro-batch-size", str(batch),
            "--global-batch-size", str(batch))


GPU = Scale(
    device="cuda", peak_sizes=(4096, 6144, 8192), model=_model_flags(12, 768, 12, 1024, 8),
    smoke_lr="6e-4", smoke_lines=None, cpu_suite=CPU_SUITE_TESTS,
    generate=("--device", "cuda", "--layers", "12", "--hidden", "768", "--heads", "12",
              "--new-tokens", "64", "--repeats", "3"),
    throughput=("--rounds", "1", "--iters", "10", "--warmup", "3"), contender_timeout_s=100,
    pytest_workers=4,
    # Llama 3.2 1B's shape (16 layers, hidden 2048, 32 heads in 8 groups, SwiGLU 8192,
    # vocabulary 128256), sequence 2048, micro-batch 4.
    llama=(*_model_flags(16, 2048, 32, 2048, 4), "--group-query-attention",
           "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--vocab-size", "128255",
           "--train-iters", "12"),
    # A Mixtral-style model at GPT-2 124M's attention: 12 layers, hidden 768, 8 experts of
    # width 2048, top-2 (about 0.45B parameters, 0.15B active), sequence 1024, micro-batch 8.
    moe=(*_model_flags(12, 768, 12, 1024, 8), "--num-experts", "8", "--moe-router-topk", "2",
         "--ffn-hidden-size", "2048", "--vocab-size", "50257", "--train-iters", "12"))
DRY_RUN = Scale(
    device="cpu", peak_sizes=(128, 256), model=_model_flags(2, 64, 4, 32, 2), smoke_lr="3e-3",
    smoke_lines=3000, cpu_suite=DRY_RUN_CPU_SUITE_TESTS,
    generate=("--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4",
              "--vocab", "1024", "--new-tokens", "8", "--repeats", "1"),
    throughput=("--rounds", "1", "--iters", "2", "--warmup", "1", "--dry-run"),
    contender_timeout_s=120, pytest_workers=0,
    llama=(*_model_flags(2, 64, 4, 32, 2), "--group-query-attention", "--num-query-groups",
           "2", "--ffn-hidden-size", "128", "--vocab-size", "1023", "--train-iters", "5"),
    moe=(*_model_flags(2, 64, 4, 32, 2), "--num-experts", "4", "--moe-router-topk", "2",
         "--ffn-hidden-size", "128", "--vocab-size", "1023", "--train-iters", "5"))
LLAMA_WARMUP = 3  # iterations left out of the Llama step's throughput


class Checks:
    """The checks and figures of one step, written to ``WORK/STEP.json``."""

    def __init__(self) -> None:
        self.checks: list[list] = []
        self.figures: dict = {}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a check (and print it); returns ``ok``."""
        self.checks.append([name, bool(ok), detail])
        print(f"check: {name}: {'ok' if ok else 'FAILED'}{f' ({detail})' if detail else ''}",
              flush=True)
        return bool(ok)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"checks": self.checks, "figures": self.figures},
                                   indent=1, default=str))


def stream(command: list[str], cwd: Path = REPO, timeout: Optional[float] = None) -> tuple:
    """Run ``command``, echoing its output as it comes; (exit status, output)."""
    print(f"$ {' '.join(command)}".replace(str(REPO) + os.sep, ""), flush=True)
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(timeout=timeout), "".join(lines)


def load_benchmark(name: str):
    """``benchmarks/{name}.py`` as a module (registered in sys.modules for its dataclasses)."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def find_inputs(inputs: Path) -> dict[str, Optional[Path]]:
    """The data folder and nanoGPT's model.py: the prepared ones, else ../shared's."""
    def first(*candidates: Path) -> Optional[Path]:
        return next((c for c in candidates if c.exists()), None)

    shared = REPO.parent / "shared"
    return {"data": first(inputs / "data", shared / "data"),
            "nanogpt": first(inputs / "peers" / "nanogpt" / "model.py",
                             shared / "peers" / "nanogpt" / "model.py")}


# env ----------------------------------------------------------------------------------------


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> Optional[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                               "clocks.max.sm,power.limit", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit_info(repo: Path = REPO) -> dict:
    """The checkout's commit and whether it has uncommitted changes (None where no git)."""
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(status) if status is not None else None}


def _commit(inputs: Path) -> dict:
    """The commit: from git where the checkout has it, else as recorded by --prepare."""
    found = commit_info(REPO)
    if found["commit"]:
        return {**found, "source": "git"}
    prepared = inputs / "prepared.json"
    if prepared.is_file():
        record = json.loads(prepared.read_text())
        return {"commit": record.get("commit"), "dirty": record.get("dirty"),
                "source": f"--prepare at {record.get('prepared')}"}
    return {"commit": None, "dirty": None, "source": "unknown"}


def step_env(scale: Scale, args, out: Checks) -> None:
    import torch

    f = out.figures
    f.update(python=platform.python_version(), platform=platform.platform(),
             torch=torch.__version__, cuda=torch.version.cuda, cpus=os.cpu_count(),
             packages={p: _version(p) for p in PACKAGES}, commit=_commit(args.inputs),
             nvidia_smi=_nvidia_smi(), gpu_visible=torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        f.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                 gpu_memory_gib=props.total_memory / 2**30,
                 multiprocessors=props.multi_processor_count,
                 cudnn=torch.backends.cudnn.version(),
                 nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    else:
        f["device_name"] = "cpu"
    # lazy: runs in the step's own process; gpu_check.py imports this module torch-free
    import megatron

    f["megatron_from"] = str(Path(megatron.__file__).resolve().parent)
    out.check("megatron is imported from this checkout", f["megatron_from"]
              == str(REPO / "megatron"), f["megatron_from"])
    out.check("a GPU is visible" if scale.device == "cuda" else "runs on the CPU (--dry-run)",
              scale.device == "cpu" or torch.cuda.is_available(), f["device_name"])
    peers = load_benchmark("gpu_peers")
    peak = peers.matmul_peak_tflops(sizes=scale.peak_sizes, device=scale.device)
    f["peak_tflops"] = peak["tflops"]
    print(f"bf16 matmul peak: {peak['tflops']:.1f} TFLOP/s (square {scale.peak_sizes})")
    out.check("the bf16 matmul peak was measured", peak["tflops"] > 0, f"{peak['tflops']:.1f}")
    found = find_inputs(args.inputs)
    f["inputs"] = {k: str(v) if v else None for k, v in found.items()}
    out.check("GPT-2 vocabulary and WikiText found", found["data"] is not None,
              f"{found['data']} (python benchmarks/gpu_check.py --prepare, and carry it)")
    out.check("nanoGPT's model.py found", found["nanogpt"] is not None, str(found["nanogpt"]))
    print(json.dumps(f, indent=1, default=str))


# gpu-tests, cpu-tests -----------------------------------------------------------------------

USAGE_ERROR = 4  # pytest's exit status for a command line it does not accept
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (.+)$", re.M)


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line (``error`` and ``errors`` both as ``error``)."""
    last = [line for line in output.splitlines() if re.search(r" in [\d.]+s", line)]
    counts = {}
    for number, what in _COUNT.findall(last[-1] if last else ""):
        counts[what.rstrip("s") if what.startswith("error") else what] = int(number)
    return counts


def parallel_args(workers: int, distribution: str) -> list[str]:
    """pytest-xdist's flags for ``workers`` processes (the GPU machine has it and 16 cores;
    the GPU tests are small enough to share one GPU), or none where it is not installed."""
    import importlib.util

    if workers < 2 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(workers), "--dist", distribution]


def run_pytest(tests: tuple[str, ...], marker: Optional[str], out: Checks,
               parallel: list[str]) -> dict:
    def command(extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                "--durations=10", *extra, *(("-m", marker) if marker else ()), *tests]

    status, output = stream(command(parallel))
    if status == USAGE_ERROR and parallel:  # xdist there but not loadable: one process
        print("pytest refused the xdist flags; running the tests in one process", flush=True)
        status, output = stream(command([]))
    counts = pytest_counts(output)
    out.figures.update(exit_status=status, counts=counts,
                       outcomes=[" ".join(m) for m in _OUTCOME.findall(output)])
    return counts


def step_gpu_tests(scale: Scale, args, out: Checks) -> None:
    # Test by test: the module fixtures (a small corpus) are cheap to build per process.
    counts = run_pytest(GPU_TESTS, "gpu", out, parallel_args(scale.pytest_workers, "load"))
    bad = counts.get("failed", 0) + counts.get("error", 0)
    if scale.device == "cuda":
        out.check("every GPU test passes", bad == 0 and counts.get("passed", 0) > 0,
                  json.dumps(counts))
    else:  # the CPU: collected and skipped, as CI does
        out.check("the GPU tests are collected (and skipped: no GPU)",
                  bad == 0 and counts.get("skipped", 0) > 0, json.dumps(counts))


def step_cpu_tests(scale: Scale, args, out: Checks) -> None:
    # Module by module: the pipeline-layout module spawns each world size once for all its
    # tests, which must stay in one process to share that.
    counts = run_pytest(scale.cpu_suite, None, out,
                        parallel_args(scale.pytest_workers, "loadscope"))
    bad = counts.get("failed", 0) + counts.get("error", 0)
    out.check("the CPU-suite tests pass", bad == 0 and counts.get("passed", 0) > 0,
              json.dumps(counts))


# smoke ----------------------------------------------------------------------------------------


def wikitext_jsonl(data: Path, path: Path, max_lines: Optional[int]) -> int:
    """WikiText-2's validation and test text as JSON lines, a document per non-blank line
    (as a user's corpus would come); returns the number of documents."""
    lines = [line.strip() for split in ("valid", "test")
             for line in (data / "wikitext-2" / f"{split}.txt").read_text().splitlines()]
    lines = [line for line in lines if line][:max_lines]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return len(lines)


def preprocess(data: Path, work: Path, scale: Scale, out: Checks) -> Optional[list[str]]:
    """The corpus through tools/preprocess_data.py; the data and tokenizer flags, or None."""
    documents = wikitext_jsonl(data, work / "wikitext.jsonl", scale.smoke_lines)
    vocab, merges = data / "gpt2" / "gpt2-vocab.json", data / "gpt2" / "gpt2-merges.txt"
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                 "--merge-file", str(merges)]
    status, _ = stream([sys.executable, "tools/preprocess_data.py", "--input",
                        str(work / "wikitext.jsonl"), "--output-prefix", str(work / "wikitext"),
                        *tokenizer, "--append-eod", "--workers", str(min(8, os.cpu_count()))])
    out.figures["documents"] = documents
    if not out.check("tools/preprocess_data.py tokenized WikiText", status == 0,
                     f"{documents} documents"):
        return None
    return ["--data-path", str(work / "wikitext_text_document"), "--split", "100,0,0",
            "--data-cache-path", str(work / "index-cache"), *tokenizer]


def smoke_command(scale: Scale, data_flags: list[str], *extra: str) -> list[str]:
    """pretrain_gpt.py in bf16, 30 iterations, dropout on, deterministic kernels."""
    return [sys.executable, "pretrain_gpt.py", *scale.model, *data_flags, "--bf16",
            "--train-iters", "30", "--lr", scale.smoke_lr, "--min-lr", "6e-5",
            "--lr-warmup-iters", "5", "--lr-decay-iters", "30", "--lr-decay-style", "cosine",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
            "--deterministic-mode", *(("--use-cpu",) if scale.device == "cpu" else ()), *extra]


def train(command: list[str]) -> tuple[list[tuple[float, float]], str]:
    """(lm loss, grad norm) per logged iteration, and the output; [] where it failed."""
    # lazy: runs in the step's own process; gpu_check.py imports this module torch-free
    from megatron.training.log import parse_log_lines

    status, output = stream(command)
    if status != 0:
        return [], output
    return [(line.get("lm loss"), line.get("grad norm")) for line in parse_log_lines(output)], \
        output


def _differs(a: list, b: list) -> str:
    """Where two runs' (loss, grad norm) lists part, for a failed check's detail."""
    if len(a) != len(b):
        return f"{len(a)} iterations against {len(b)}"
    diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not diffs:
        return "identical"
    i = diffs[0]
    largest = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    return f"first differs at index {i}: {a[i]} vs {b[i]}; largest loss difference {largest:.3g}"


def step_smoke(scale: Scale, args, out: Checks) -> None:
    # lazy: runs in the step's own process; gpu_check.py imports this module torch-free
    from megatron.checkpointing import read_tracker

    data = find_inputs(args.inputs)["data"]
    if not out.check("WikiText and the GPT-2 vocabulary found", data is not None):
        return
    data_flags = preprocess(data, args.work, scale, out)
    if data_flags is None:
        return
    save = str(args.work / "smoke-checkpoint")
    straight, log = train(smoke_command(scale, data_flags))
    device_line = next((line for line in log.splitlines() if "> compute device:" in line), "")
    expected = "cuda:0, collectives: nccl" if scale.device == "cuda" else "cpu, collectives: gloo"
    out.check("trains on the expected device", expected in device_line, device_line.strip())
    losses = [loss for loss, _ in straight]
    out.figures.update(losses=losses, device_line=device_line.strip(),
                       memory_line=next((ln for ln in log.splitlines() if "memory (MB)" in ln),
                                        None))
    finite = len(losses) == 30 and all(math.isfinite(v) for v in losses)
    if not out.check("30 iterations with finite losses", finite, f"{len(losses)} logged"):
        return
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    out.check("the loss falls by at least 1 (mean of the last 5 against the first 5)",
              last < first - 1.0, f"{first:.3f} -> {last:.3f}")
    half, _ = train(smoke_command(scale, data_flags, "--save", save, "--save-interval", "15",
                                  "--exit-interval", "15"))
    tracker = read_tracker(save)
    out.check("the first half stops at 15 with a checkpoint, losses as the straight run",
              tracker is not None and tracker.iteration == 15 and half == straight[:15],
              f"tracker {tracker.iteration if tracker else None}; {_differs(half, straight[:15])}")
    resumed, _ = train(smoke_command(scale, data_flags, "--load", save))
    out.check("the resume reproduces iterations 16-30 exactly (loss and grad norm)",
              resumed == straight[15:], _differs(resumed, straight[15:]))
    flash, flash_log = train(smoke_command(scale, data_flags, "--use-flash-attn"))
    fallback = "flash_attn package is not installed" in flash_log
    out.figures["flash_attn_fallback_line"] = fallback
    out.check("--use-flash-attn gives the same losses", flash == straight,
              ("SDPA fallback; " if fallback else "flash_attn installed; ")
              + _differs(flash, straight))


# generate, throughput -------------------------------------------------------------------------


def step_generate(scale: Scale, args, out: Checks) -> None:
    report = args.work / "generate.json"
    status, _ = stream([sys.executable, "benchmarks/generate.py", *scale.generate,
                        "--batch-sizes", "1", "8", "--json", str(report)])
    if not out.check("benchmarks/generate.py ran", status == 0 and report.is_file(),
                     f"exit status {status}"):
        return
    rows = json.loads(report.read_text())
    out.figures.update(rows)
    cached = [r for r in rows["rows"] if r["generator"] == "ours (KV cache)"]
    out.check("cached generation ran at batch 1 and 8",
              sorted(r["batch"] for r in cached) == [1, 8]
              and all(r["tokens_per_s"] > 0 for r in cached))


def llama_command(scale: Scale) -> list[str]:
    """pretrain_gpt.py with the Llama family's options in bf16 on mock data, flash attention
    where installed (SDPA otherwise, grouped k/v either way)."""
    return _llama_family(scale, scale.llama)


def moe_command(scale: Scale) -> list[str]:
    """The Llama options with mixture-of-experts layers: SwiGLU experts computed by grouped
    products, dropless, the load-balancing loss on."""
    return [*_llama_family(scale, scale.moe), "--moe-grouped-gemm", "--moe-aux-loss-coeff",
            "1e-2"]


def _llama_family(scale: Scale, shape: tuple[str, ...]) -> list[str]:
    return [sys.executable, "pretrain_gpt.py", *shape, "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--normalization", "RMSNorm", "--swiglu",
            "--position-embedding-type", "rope", "--rotary-base", "500000",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16",
            "--use-flash-attn", "--lr", "3e-4", "--clip-grad", "1.0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--eval-iters", "0", *(("--use-cpu",) if scale.device == "cpu" else ())]


def step_llama(scale: Scale, args, out: Checks) -> None:
    """A Llama 1B-shape training run: finite losses, tokens/s and MFU after the warm-up."""
    _pretrain_step(llama_command(scale), "the Llama shape", args, out)


def step_moe(scale: Scale, args, out: Checks) -> None:
    """A mixture-of-experts training run: finite losses, tokens/s and MFU (active FLOPs)."""
    _pretrain_step(moe_command(scale), "the mixture-of-experts shape", args, out)


def _pretrain_step(command: list[str], what: str, args, out: Checks) -> None:
    # lazy: runs in the step's own process; gpu_check.py imports this module torch-free
    from megatron.training.log import parse_log_lines

    status, log = stream(command)
    lines = parse_log_lines(log) if status == 0 else []
    losses = [line.get("lm loss") for line in lines]
    if not out.check(f"pretrain_gpt.py trained {what} with finite losses",
                     bool(losses) and all(v is not None and math.isfinite(v) for v in losses),
                     f"exit status {status}, {len(losses)} iterations"):
        return
    timed = [line for line in lines if line["iteration"] > LLAMA_WARMUP]
    tgs = [line["tokens per GPU per second (TGS)"] for line in timed]
    tflops = [line.get("TFLOP/s per GPU") for line in timed]
    out.figures.update(losses=losses, tokens_per_s=statistics.median(tgs) if tgs else None,
                       tflops=statistics.median(tflops) if tflops and None not in tflops
                       else None,
                       memory_line=next((ln for ln in log.splitlines() if "memory (MB)" in ln),
                                        None))
    if args.peak_tflops and out.figures["tflops"]:
        out.figures["mfu"] = out.figures["tflops"] / args.peak_tflops


def step_throughput(shape: str) -> Callable:
    def run(scale: Scale, args, out: Checks) -> None:
        # Written after every contender: if the step is stopped, gpu_check keeps what ran.
        report = args.work / f"{args.worker}.figures.json"
        nanogpt = find_inputs(args.inputs)["nanogpt"]
        command = [sys.executable, "benchmarks/train_throughput.py", "--device", "cuda",
                   "--shapes", shape, *scale.throughput, "--json", str(report),
                   "--contender-timeout", str(scale.contender_timeout_s),
                   *(("--nanogpt", str(nanogpt)) if nanogpt else ()),
                   *(("--peak-tflops", repr(args.peak_tflops)) if args.peak_tflops else ())]
        status, _ = stream(command)
        if not out.check("benchmarks/train_throughput.py ran", status == 0 and report.is_file(),
                         f"exit status {status}"):
            return
        record = json.loads(report.read_text())
        out.figures.update(record)
        contenders = record["shapes"][shape]["contenders"]
        failed = [name for name, s in contenders.items() if s["tokens_per_s"] is None]
        out.check("every contender ran", not failed and "nanogpt-compile" in contenders,
                  f"failed: {', '.join(failed)}" if failed else ", ".join(contenders))
    return run


STEP_FUNCTIONS = {
    "env": step_env, "gpu-tests": step_gpu_tests, "cpu-tests": step_cpu_tests,
    "smoke": step_smoke, "generate": step_generate, "llama-1b": step_llama, "moe": step_moe,
    "throughput-124m": step_throughput("gpt2-124m"),
    "throughput-350m": step_throughput("gpt2-350m"),
    "throughput-1.3b": step_throughput("1.3b"),
}


def run_worker(step: str, args) -> int:
    """Run one step in this process; its checks and figures go to ``args.work/STEP.json``."""
    sys.path.insert(0, str(REPO))
    scale = DRY_RUN if args.dry_run else GPU
    out = Checks()
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        STEP_FUNCTIONS[step](scale, args, out)
    finally:
        out.write(args.work / f"{step}.json")
    return 0
