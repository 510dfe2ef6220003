"""pretrain_gpt.py driven as a user drives it, end to end.

WikiText-2 articles as loose JSON -> tools/preprocess_data.py -> ``torchrun --nproc_per_node 4
pretrain_gpt.py --tensor-model-parallel-size 2`` (tensor 2 x data 2, gloo) with evaluation,
a checkpoint, TensorBoard and an --exit-interval stop -> a second torchrun that loads the
checkpoint and finishes. Then the user errors: an unknown flag and a global batch that does
not divide exit with status 2 and a message naming the flag, before any process group exists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from megatron.checkpointing import list_iterations, read_tracker
from tests.corpus import wikitext_articles
from tests.dist_utils import free_port
from tests.distributed.training_utils import load_tool, parse_log_lines
from tests.shared_data import MERGES, VOCAB, WIKITEXT, have_gpt2_files, have_wikitext

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG_FIELDS = [
    "consumed samples", "elapsed time per iteration (ms)", "learning rate",
    "global batch size", "lm loss", "loss scale", "grad norm", "number of skipped iterations",
    "number of nan iterations", "tokens per GPU per second (TGS)", "TFLOP/s per GPU",
]
GBS = 8


def _env(**extra) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _run(cmd, timeout=240, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO,
                          env=_env(**env), timeout=timeout)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """WikiText-2 articles through tools/preprocess_data.py; GPT-2's tokenizer when the shared
    files are there, else the corpus and tokenizer of tools/build_quickstart_corpus.py."""
    folder = tmp_path_factory.mktemp("data")
    corpus = folder / "corpus.json"
    if have_gpt2_files() and have_wikitext():
        with open(corpus, "w", encoding="utf-8") as f:
            for article in wikitext_articles(max_chars=150_000):
                f.write(json.dumps({"text": article}) + "\n")
        vocab, merges = VOCAB, MERGES
    else:
        tool = load_tool("build_quickstart_corpus")
        # Not the tool's default (../shared beside the checkout): what tests/shared_data.py
        # found, which MEGATRON_TEST_DATA may hide.
        tool.build_corpus(corpus, WIKITEXT if have_wikitext() else None, max_chars=150_000)
        vocab, merges = tool.train_tokenizer(tool.read_json_texts(corpus), folder / "tok", 1024)
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                 "--merge-file", str(merges)]
    done = _run([sys.executable, "tools/preprocess_data.py", "--input", corpus,
                 "--output-prefix", folder / "wiki", "--append-eod", "--workers", "2",
                 *tokenizer])
    assert done.returncode == 0, done.stderr
    return {"prefix": str(folder / "wiki_text_document"), "tokenizer": tokenizer}


def _flags(dataset, **overrides) -> list[str]:
    flags = {
        "--tensor-model-parallel-size": 2, "--use-cpu": True,
        "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4,
        "--seq-length": 64, "--max-position-embeddings": 64, "--micro-batch-size": 2,
        "--global-batch-size": GBS, "--train-iters": 6, "--lr": 1e-3, "--min-lr": 1e-4,
        "--lr-warmup-iters": 1, "--lr-decay-style": "cosine", "--clip-grad": 1.0,
        "--log-interval": 1, "--eval-interval": 3, "--eval-iters": 2, "--split": "90,5,5",
        "--num-workers": 0, "--data-path": dataset["prefix"],
    }
    flags.update(overrides)
    argv = []
    for name, value in flags.items():
        argv += [name] if value is True else [name, str(value)]
    return argv + dataset["tokenizer"]


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), "pretrain_gpt.py", *args]
    return _run(cmd)


@pytest.fixture(scope="module")
def two_runs(dataset, tmp_path_factory):
    """Run 1 trains 4 of 6 iterations (--exit-interval 4), run 2 loads and finishes."""
    folder = tmp_path_factory.mktemp("run")
    save, tb = str(folder / "ckpt"), str(folder / "tb")
    common = ["--save", save, "--save-interval", "3", "--tensorboard-dir", tb,
              "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard"]
    first = _torchrun(_flags(dataset) + common + ["--exit-interval", "4"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    tracker_after_first = read_tracker(save)
    second = _torchrun(_flags(dataset) + common + ["--load", save])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return dict(first=first.stdout, second=second.stdout, save=save, tb=tb,
                tracker_after_first=tracker_after_first)


def test_log_lines_have_every_field(two_runs):
    for text, iterations in ((two_runs["first"], [1, 2, 3, 4]),
                             (two_runs["second"], [5, 6])):
        lines = parse_log_lines(text)
        assert [line["iteration"] for line in lines] == iterations
        for line in lines:
            missing = [f for f in LOG_FIELDS if f not in line]
            assert not missing, (missing, line)
            assert line["consumed samples"] == GBS * line["iteration"]
            assert line["global batch size"] == GBS
            assert line["number of skipped iterations"] == 0
            assert line["number of nan iterations"] == 0
            assert line["loss scale"] == 1.0
            assert line["elapsed time per iteration (ms)"] > 0
            assert line["tokens per GPU per second (TGS)"] > 0
            assert line["TFLOP/s per GPU"] >= 0
            assert 0 < line["lm loss"] < 12 and line["grad norm"] > 0
    first = parse_log_lines(two_runs["first"])
    assert first[-1]["lm loss"] < first[0]["lm loss"]


def test_arguments_block_shows_what_the_device_uses(two_runs):
    """On the CPU no LayerNorm is apex's, whatever is installed: the block says False."""
    assert re.search(r"\n  apex_layernorm \.+ False\n", two_runs["first"])


def test_evaluation_lines(two_runs):
    pattern = r"validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+)"
    first = re.findall(pattern, two_runs["first"])
    second = re.findall(pattern, two_runs["second"])
    assert [int(m[0]) for m in first] == [3] and [int(m[0]) for m in second] == [6]
    for _, loss, ppl in first + second:
        assert float(ppl) == pytest.approx(2.718281828 ** float(loss), rel=1e-5)
    assert "test loss at the end of training (iteration 6)" in two_runs["second"]


def test_checkpoint_and_resume(two_runs):
    save = two_runs["save"]
    assert two_runs["tracker_after_first"].iteration == 4
    assert "exiting at iteration 4 (--exit-interval reached); checkpoint saved" in \
        two_runs["first"]
    assert "training from iteration 4 to 6" in two_runs["second"]
    assert list_iterations(save) == [3, 4, 6]
    assert read_tracker(save).iteration == 6
    for it in (3, 4, 6):  # one folder per tensor-parallel rank, written by data rank 0
        folder = os.path.join(save, f"iter_{it:07d}")
        assert sorted(os.listdir(folder)) == ["manifest.json", "mp_rank_00", "mp_rank_01"]


def test_tensorboard_scalars(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [f for f in os.listdir(two_runs["tb"]) if f.startswith("events.out.tfevents")]
    assert len(events) == 2  # one writer per run, on global rank 0 only
    acc = EventAccumulator(two_runs["tb"], size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size",
                "tokens-per-gpu-per-second", "tflops-per-gpu", "iteration-time-ms",
                "lm loss validation", "lm loss validation ppl"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in acc.Scalars("lm loss validation")] == [3, 6]
    logged = [line["lm loss"] for line in parse_log_lines(two_runs["first"])]
    written = [e.value for e in acc.Scalars("lm loss")][:4]
    assert written == pytest.approx(logged, rel=1e-5)


def test_resume_says_what_was_loaded(two_runs):
    save = two_runs["save"]
    assert (f"successfully loaded checkpoint from {save} at iteration 4 "
            f"({save}/iter_0000004, {4 * GBS} samples consumed); restored: model, "
            "optimizer state, LR schedule, RNG state\n") in two_runs["second"]
    assert "successfully loaded" not in two_runs["first"]


def _summary(text: str) -> dict:
    """The fields of the run's summary line, which must be its last line."""
    last = text.rstrip("\n").splitlines()[-1]
    assert last.startswith(" run summary | "), last
    fields = dict(part.strip().split(": ", 1) for part in last.split("|")[1:-1]
                  if ": " in part)
    fields["no checkpoint"] = "no checkpoint saved" in last
    return fields


def test_run_ends_with_a_summary(two_runs):
    save = two_runs["save"]
    for text, iterations, valid_at, checkpoint in ((two_runs["first"], 4, 3, 4),
                                                   (two_runs["second"], 2, 6, 6)):
        summary = _summary(text)
        assert int(summary["iterations"]) == iterations
        assert int(summary["tokens"]) == iterations * GBS * 64
        assert float(summary["wall time (s)"]) > 0
        assert float(summary["mean tokens per GPU per second (TGS)"]) > 0
        assert float(summary["mean TFLOP/s per GPU"]) >= 0
        logged = parse_log_lines(text)[-1]["lm loss"]  # --log-interval 1: the last iteration
        assert float(summary["last train lm loss"]) == pytest.approx(logged, rel=1e-6)
        valid = re.findall(rf"validation loss at iteration {valid_at} \| lm loss value: (\S+)",
                           text)
        assert summary["last validation lm loss"] == valid[0]
        assert summary["last checkpoint"] == os.path.join(save, f"iter_{checkpoint:07d}")


def test_tensorboard_has_megatron_deepspeed_series(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(two_runs["tb"], size_guidance={"scalars": 0})
    acc.Reload()
    iterations = [1, 2, 3, 4, 5, 6]
    samples = [GBS * i for i in iterations]
    tokens = [64 * n for n in samples]

    def steps(tag):
        return [e.step for e in acc.Scalars(tag)]

    for tag in ("lm-loss-training/lm loss", "learning-rate/learning-rate",
                "batch-size/batch-size", "grad-norm/grad-norm"):
        assert steps(tag) == iterations, tag
        assert steps(f"{tag} vs samples") == samples, tag
        assert steps(f"{tag} vs tokens") == tokens, tag
    loss = [e.value for e in acc.Scalars("lm loss")]
    assert [e.value for e in acc.Scalars("lm-loss-training/lm loss vs tokens")] == loss
    assert {e.value for e in acc.Scalars("batch-size/batch-size vs samples")} == {GBS}
    for tag in ("lm-loss-validation/lm loss validation",
                "lm-loss-validation/lm loss validation ppl"):
        assert steps(tag) == [3, 6]
        assert steps(f"{tag} vs samples") == [3 * GBS, 6 * GBS]
        assert steps(f"{tag} vs tokens") == [3 * GBS * 64, 6 * GBS * 64]
    assert steps("lm-loss-validation/lm loss test") == [6]
    assert [e.value for e in acc.Scalars("steps-vs-samples/y=steps,x=samples")] == iterations
    assert steps("steps-vs-samples/y=steps,x=samples") == samples
    assert [e.value for e in acc.Scalars("steps-vs-tokens/y=tokens,x=steps")] == tokens
    assert steps("steps-vs-tokens/y=steps,x=tokens") == tokens


# User errors: exit 2 with the flag named, before any process group -----------------------


def _rank0_of(world_size: int) -> dict:
    # Rank 0 of a world whose other ranks never come: making a process group would block
    # until the subprocess timeout, so a prompt exit proves none was attempted.
    return dict(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


@pytest.mark.parametrize("overrides,extra,named", [
    ({}, ["--global-batch-sise", "8"], "--global-batch-sise (did you mean --global-batch-size?)"),
    ({"--global-batch-size": 6}, [], "--global-batch-size (6) is not divisible"),
], ids=["unknown-flag", "batch-not-divisible"])
def test_user_error_exits_2_naming_the_flag(dataset, overrides, extra, named):
    cmd = [sys.executable, "pretrain_gpt.py", *_flags(dataset, **overrides), *extra]
    done = _run(cmd, timeout=60, **_rank0_of(4))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert named in done.stderr
    assert done.stderr.startswith("error: ")
    assert "iteration" not in done.stdout


def test_help_does_not_import_the_compiler():
    """--help (and every start-up) skips torch._dynamo, about 2 s of imports on a CPU; a run
    imports it only when it compiles. Timings: benchmarks' business, not a test's."""
    done = _run([sys.executable, "-X", "importtime", "pretrain_gpt.py", "--help"], timeout=60)
    assert done.returncode == 0 and "--tensor-model-parallel-size" in done.stdout
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()}
    assert "torch" in imported and "torch._dynamo" not in imported


# Example launch scripts: run with stand-in launchers that record what they were asked -----


FAKE_LAUNCHER = """#!{python}
import json, os, sys
with open(os.environ["LAUNCH_CAPTURE"], "a") as f:
    f.write(json.dumps({{"launcher": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                         "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
                         "MASTER_ADDR": os.environ.get("MASTER_ADDR")}}) + "\\n")
"""


@pytest.fixture
def fake_launchers(tmp_path):
    """A bin folder with torchrun and srun stand-ins (and no scontrol: the SLURM script must
    not need it), and a python wrapper whose ``-m torch.distributed.run`` is the torchrun
    stand-in; returns (env, read_calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "srun"):
        (bin_dir / name).write_text(FAKE_LAUNCHER.format(python=sys.executable))
    (bin_dir / "python").write_text(
        "#!/bin/bash\n"
        f'if [ "$1 $2" = "-m torch.distributed.run" ]; then shift 2; exec {bin_dir}/torchrun "$@"; fi\n'
        f'exec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    capture = tmp_path / "launches.jsonl"
    env = dict(PATH=f"{bin_dir}:{os.environ['PATH']}", LAUNCH_CAPTURE=str(capture),
               PYTHON=str(bin_dir / "python"))

    def read_calls():
        if not capture.is_file():
            return []
        return [json.loads(line) for line in capture.read_text().splitlines()]

    return env, read_calls


def _launcher_option(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _pretrain_config(call: dict, world_size: int):
    from megatron.config import parse_args

    argv = call["argv"]
    script = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    return parse_args(argv[script + 1:], world_size=world_size)


def _torchrun_world(argv: list[str]) -> int:
    return (int(_launcher_option(argv, "--nproc_per_node", "1"))
            * int(_launcher_option(argv, "--nnodes", "1")))


def test_gpt3_175b_script_is_megatrons_recipe(fake_launchers):
    env, calls = fake_launchers
    done = _run(["bash", "examples/gpt3/train_gpt3_175b_distributed.sh", "/ck", "/tb",
                 "/v.json", "/m.txt"], timeout=60, DATASET_PATH="/corpora",
                DATASETCACHE="/cache", **env)
    assert done.returncode == 0, done.stderr
    [call] = calls()
    assert call["launcher"] == "torchrun"
    argv = call["argv"]
    assert (_launcher_option(argv, "--nproc_per_node", ""), _launcher_option(argv, "--nnodes", ""),
            _launcher_option(argv, "--node_rank", ""), _launcher_option(argv, "--master_addr", ""),
            _launcher_option(argv, "--master_port", "")) == ("8", "8", "0", "localhost", "6000")
    world = _torchrun_world(argv)
    assert world == 64
    cfg = _pretrain_config(call, world)
    m, p, t, o, s = cfg.model, cfg.parallel, cfg.training, cfg.optimizer, cfg.scheduler
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 8)
    assert cfg.data_parallel_size == 1 and m.use_flash_attn
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == \
        (96, 12288, 96, 2048)
    assert m.init_method_std == 0.006
    assert (t.micro_batch_size, t.global_batch_size, t.rampup_batch_size) == \
        (1, 1536, (16, 16, 5859375))
    assert t.train_samples == 146484375
    assert (o.lr, o.min_lr, o.clip_grad, o.weight_decay, o.adam_beta1, o.adam_beta2) == \
        (6e-5, 6e-6, 1.0, 0.1, 0.9, 0.95)
    assert o.fp16 and not o.bf16
    assert (s.lr_decay_style, s.lr_warmup_samples, s.lr_decay_samples) == \
        ("cosine", 183105, 126953125)
    assert list(cfg.data.data_path) == [
        "0.35", "/corpora/wikipedia_20220301_en_text_document",
        "0.65", "/corpora/openwebtext_Skylion007_text_document"]
    assert cfg.data.data_cache_path == "/cache"
    assert (cfg.checkpoint.save, cfg.checkpoint.load, cfg.logging.tensorboard_dir) == \
        ("/ck", "/ck", "/tb")
    assert (cfg.data.vocab_file, cfg.data.merge_file) == ("/v.json", "/m.txt")


def test_distributed_and_slurm_scripts_launch_valid_runs(fake_launchers):
    env, calls = fake_launchers
    args = ["/ck", "/v.json", "/m.txt", "0.3 /a_text_document 0.7 /b_text_document",
            "--seed", "7"]
    done = _run(["bash", "examples/pretrain_gpt_distributed.sh", *args], timeout=60,
                TP="2", PP="2", PRECISION="--bf16", **env)
    assert done.returncode == 0, done.stderr
    done = _run(["bash", "examples/slurm/pretrain_gpt_slurm.sh", *args], timeout=60,
                SLURM_NTASKS="16", SLURM_JOB_NODELIST="node[001-002]", SLURM_SUBMIT_DIR=REPO,
                **env)
    assert done.returncode == 0, done.stderr
    torchrun, srun = calls()
    assert (torchrun["launcher"], srun["launcher"]) == ("torchrun", "srun")
    cfg = _pretrain_config(torchrun, _torchrun_world(torchrun["argv"]))
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
            cfg.parallel.data_parallel_size) == (2, 2, 2)
    assert cfg.optimizer.bf16 and cfg.training.seed == 7
    assert list(cfg.data.data_path) == ["0.3", "/a_text_document", "0.7", "/b_text_document"]
    # The script sets no world size or rendezvous: each task reads srun's own variables.
    assert srun["WORLD_SIZE"] is None and srun["MASTER_ADDR"] is None
    cfg = _pretrain_config(srun, 16)
    assert cfg.parallel.data_parallel_size == 8 and cfg.optimizer.fp16


# The same scripts at toy size, really launched: torchrun itself, and an srun stand-in that
# runs its one task here. Later flags override the script's 345M model.

ONE_TASK_SRUN = """#!/bin/bash
# srun for a one-task job on this machine: drop srun's options, set what it sets, run.
while [ "${1#-}" != "$1" ]; do shift; done
SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@"
"""
PRINTED_PRECISION = {"fp32": ("False", "False", "torch.float32"),
                     "bf16": ("False", "True", "torch.bfloat16"),
                     "fp16": ("True", "False", "torch.float16")}


@pytest.fixture
def one_task_srun(tmp_path):
    """PATH with an srun that runs its task here and a python that is this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(ONE_TASK_SRUN)
    (bin_dir / "python").write_text(f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    # No MASTER_ADDR: the task finds rank 0's host in the node list, as under a real srun.
    return dict(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NTASKS="1",
                SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=REPO, GPUS_PER_NODE="1",
                TP="1")


def _printed_argument(stdout: str, name: str) -> str:
    """The value of ``name`` in the run's printed arguments block."""
    [value] = re.findall(rf"^  {name} \.+ (.*)$", stdout, flags=re.MULTILINE)
    return value


TOY_FLAGS = ["--use-cpu", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
             "2", "--seq-length", "16", "--max-position-embeddings", "16",
             "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2",
             "--lr-decay-iters", "2", "--log-interval", "1", "--eval-interval", "2",
             "--eval-iters", "1", "--split", "90,5,5", "--num-workers", "0"]


@pytest.mark.parametrize("script", [
    # The one that also trains on the dataset fixture's fallback in CI's second pass.
    pytest.param("examples/pretrain_gpt_distributed.sh", marks=pytest.mark.shared_data),
    "examples/slurm/pretrain_gpt_slurm.sh"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_example_scripts_train_in_the_named_precision(dataset, one_task_srun, tmp_path,
                                                      script, precision):
    tok = dataset["tokenizer"]
    vocab, merges = tok[tok.index("--vocab-file") + 1], tok[tok.index("--merge-file") + 1]
    done = _run(["bash", script, tmp_path / "ckpt", vocab, merges, dataset["prefix"],
                 *TOY_FLAGS], timeout=180, PRECISION=precision, MASTER_PORT=str(free_port()),
                **one_task_srun)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = tuple(_printed_argument(done.stdout, name)
                    for name in ("fp16", "bf16", "params_dtype"))
    assert printed == PRINTED_PRECISION[precision]
    assert [line["iteration"] for line in parse_log_lines(done.stdout)] == [1, 2]


@pytest.mark.parametrize("value", ["", "fp8", "float32"])
def test_example_scripts_refuse_an_unknown_precision(value):
    for script in ("examples/pretrain_gpt_distributed.sh", "examples/slurm/pretrain_gpt_slurm.sh",
                   "examples/gpt3/train_gpt3_175b_distributed.sh",
                   "examples/gpt3/train_gpt3_175b_distributed_tgs.sh",
                   "examples/pretrain_gpt_single_node.sh", "examples/pretrain_gpt.sh"):
        done = _run(["bash", script, "/ck", "/v.json", "/m.txt", "/d"], timeout=60,
                    PRECISION=value)
        assert done.returncode == 2, (script, done.stdout, done.stderr)
        assert done.stderr.strip() == \
            f"error: PRECISION='{value}' is not one of fp32, bf16, fp16", script


def test_quickstart_builds_everything_and_launches_tp2(fake_launchers, tmp_path):
    env, calls = fake_launchers
    out = tmp_path / "qs"
    corpus = tmp_path / "my corpus.json"  # the user's own corpus, with a space in its path
    tool = load_tool("build_quickstart_corpus")
    tool.build_corpus(corpus, tmp_path / "no-wikitext", max_chars=60_000)
    settings = dict(OUT_DIR=str(out), CORPUS_JSON=str(corpus), VOCAB_SIZE="300",
                    TRAIN_ITERS="3", **env)
    done = _run(["bash", "examples/quickstart_cpu.sh"], timeout=120, **settings)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    stages = re.findall(r"==> \[\d+s\] ([a-z ]+)", done.stdout)
    assert stages == ["building corpus", "training tokenizer", "preprocessing", "training",
                      "sampling", "done in "], done.stdout
    assert "sampling: skipped (no checkpoint" in done.stdout  # the stand-in trained nothing
    vocab = json.loads((out / "tokenizer" / "bpe300-my corpus" / "vocab.json").read_text())
    assert len(vocab) == 300 and vocab["<|endoftext|>"] == 299
    [call] = calls()
    assert _launcher_option(call["argv"], "--nproc_per_node", "") == "2"
    cfg = _pretrain_config(call, 2)
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.pipeline_model_parallel_size == 1
    data = cfg.data.data_path[0]
    assert os.path.isfile(data + ".bin") and os.path.isfile(data + ".idx")
    assert cfg.checkpoint.save == cfg.checkpoint.load == str(out / "checkpoints")
    assert cfg.logging.tensorboard_dir == str(out / "tensorboard")
    assert cfg.training.train_iters == 3 and cfg.training.eval_iters > 0
    # Re-running reuses what was built; PP=2 switches on pipeline parallelism.
    again = _run(["bash", "examples/quickstart_cpu.sh"], timeout=120, PP="2", **settings)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("reusing") == 2  # the tokenizer and the dataset
    call = calls()[-1]
    assert _launcher_option(call["argv"], "--nproc_per_node", "") == "4"
    assert _pretrain_config(call, 4).parallel.pipeline_model_parallel_size == 2
    # With a finished checkpoint, training is skipped and the run ends by sampling from it
    # at its layout (issue 14).
    (out / "checkpoints").mkdir(exist_ok=True)
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3")
    third = _run(["bash", "examples/quickstart_cpu.sh"], timeout=120, PP="2", **settings)
    assert third.returncode == 0, third.stderr
    argv = calls()[-1]["argv"]
    assert _launcher_option(argv, "--nproc_per_node", "") == "4"
    script = next(i for i, a in enumerate(argv) if a.endswith("tools/generate_text.py"))
    assert argv[script + 1:script + 3] == ["--load", str(out / "checkpoints")]
    assert "--max-new-tokens" in argv and "--prompt" in argv


def test_quickstart_corpus_falls_back_to_python_docs(tmp_path):
    tool = load_tool("build_quickstart_corpus")
    source, count = tool.build_corpus(tmp_path / "c.json", tmp_path / "no-wikitext",
                                      max_chars=100_000)
    assert "Python" in source and count >= 5
    texts = list(tool.read_json_texts(tmp_path / "c.json"))
    assert len(texts) == count and sum(map(len, texts)) >= 100_000
    assert all(len(t) >= 200 for t in texts)
