"""Pipeline-parallel layouts train the same model as one process, through the real CLI.

Every (tensor, pipeline, data) layout below, interleaving and the distributed optimizer
included, gives the one-process losses, grad norms, params norms (--log-params-norm: tied
embeddings and tensor-parallel copies counted once) and validation losses within 1e-5
relative (fp32, real WikiText-2 tokens). Along the way:

- the tied word embeddings held by the first and the last stage are bit-identical before
  every step and at the end (a digest of each copy, taken whenever a micro-batch runs);
- resuming is bit-exact: 10 iterations straight equal 5, a checkpoint (mp_rank_XX_YYY
  folders), --load, and 5 more, loss for loss, with 1F1B and with interleaving.

Process start-up dominates the cost, so each spawn runs every layout of its world size in
turn (model-parallel groups are torn down and rebuilt between runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os

import pytest

import pretrain_gpt
from megatron import training
from megatron.core import parallel_state
from megatron.training import loop as training_loop
from tests.dist_utils import run_distributed
from tests.distributed import training_utils

ITERS = 5


def base_argv(corpus, cache_dir, **overrides) -> list[str]:
    return training_utils.base_argv(corpus, cache_dir, **{
        "--num-layers": 8, "--global-batch-size": 8, "--train-iters": ITERS, "--lr": 1e-3,
        "--min-lr": 1e-4, "--lr-warmup-iters": 1, "--lr-decay-iters": 10, "--eval-interval": 5,
        "--eval-iters": 1, "--split": "90,10,0", "--log-params-norm": True, **overrides})


# One training run inside a spawned rank --------------------------------------------------------


class Recorder:
    """Wraps pretrain_gpt's callbacks: a digest of the shared embedding whenever a training
    micro-batch runs (first and last stage run the same number per step), and every
    evaluation's loss."""

    def __init__(self) -> None:
        self.digests: list[str] = []
        self.evaluations: list[float] = []
        self.models: list = []

    def model_provider(self, ctx, **kwargs):
        model = pretrain_gpt.model_provider(ctx, **kwargs)
        self.models.append(model)
        return model

    def _note(self) -> None:
        for model in self.models:
            weight = model.shared_embedding_or_output_weight()
            if weight is not None:
                self.digests.append(hashlib.sha1(weight.detach().numpy().tobytes()).hexdigest())

    def forward_step(self, ctx, data_iterator, model, stage):
        if model.training:
            self._note()
        return pretrain_gpt.forward_step(ctx, data_iterator, model, stage)

    def evaluate(self, original):
        def wrapped(*args, **kwargs):
            losses = original(*args, **kwargs)
            self.evaluations.append(losses["lm loss"])
            return losses
        return wrapped


def train_once(argv: list[str]) -> dict:
    recorder = Recorder()
    original = training_loop.evaluate  # what the loop calls for each evaluation
    training_loop.evaluate = recorder.evaluate(original)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            state = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                                      recorder.model_provider, recorder.forward_step, argv=argv)
        recorder._note()  # the weights after the last step
        return {
            "bubble_lines": [line for line in log.getvalue().splitlines()
                             if "pipeline bubble" in line],
            "throughput_lines": [line for line in log.getvalue().splitlines()
                                 if line.startswith(" iteration")  # not the run summary
                                 and "tokens per GPU per second (TGS)" in line
                                 and "TFLOP/s per GPU" in line],
            "steps": [(h["losses"]["lm loss"], h["grad_norm"], h["params_norm"])
                      for h in state.history],
            "evaluations": recorder.evaluations,
            "digests": recorder.digests,
            "layers": [[layer.layer_number for layer in m.encoder.layers] for m in recorder.models],
            "coords": (parallel_state.get_tensor_model_parallel_rank(),
                       parallel_state.get_pipeline_model_parallel_rank(),
                       parallel_state.get_data_parallel_rank()),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        }
    finally:
        training_loop.evaluate = original
        parallel_state.destroy_model_parallel()  # the next run may use another layout


def _train_all(rank: int, world_size: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    return {name: train_once(argv) for name, argv in runs.items()}


# The runs, one spawn per world size -------------------------------------------------------------

LAYOUTS = {  # name -> (world size, flags)
    "pp2": (2, {"--pipeline-model-parallel-size": 2}),
    "pp2-uneven": (2, {"--pipeline-model-parallel-size": 2,  # 3 + 5 layers
                       "--decoder-first-pipeline-num-layers": 3}),
    # Recomputed stages: the sent activation is freed after the send, the backward runs on
    # the checkpointed graph.
    "pp2-recompute": (2, {"--pipeline-model-parallel-size": 2,
                          "--recompute-granularity": "full", "--recompute-method": "uniform",
                          "--recompute-num-layers": 1}),
    "pp4": (4, {"--pipeline-model-parallel-size": 4}),
    "tp2pp2": (4, {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2}),
    "pp2dp2": (4, {"--pipeline-model-parallel-size": 2}),
    "pp2dp2-distopt": (4, {"--pipeline-model-parallel-size": 2,
                           "--use-distributed-optimizer": True}),
    "pp4-vp2": (4, {"--pipeline-model-parallel-size": 4,
                    "--num-layers-per-virtual-pipeline-stage": 1, "--log-bubble": True}),
    "tp2pp2dp2-distopt": (8, {"--tensor-model-parallel-size": 2,
                              "--pipeline-model-parallel-size": 2,
                              "--use-distributed-optimizer": True}),
}
RESUMED = ("pp2", "pp4-vp2")  # trained 10 iterations, and 5 + checkpoint + 5
# The Llama family's options (untied embeddings: no copy on the last stage) on the pipeline.
LLAMA_LAYOUTS = {
    "llama-pp2": (2, {"--pipeline-model-parallel-size": 2, **training_utils.LLAMA_FLAGS}),
    "llama-tp2pp2": (4, {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
                         **training_utils.LLAMA_FLAGS}),
}
ALL_LAYOUTS = {**LAYOUTS, **LLAMA_LAYOUTS}


def runs_for(world: int, corpus, cache, save_root) -> dict[str, list[str]]:
    runs = {}
    for name, (size, flags) in ALL_LAYOUTS.items():
        if size != world:
            continue
        if name not in RESUMED:
            runs[name] = base_argv(corpus, cache, **flags)
            continue
        save = os.path.join(save_root, name)
        long = {**flags, "--train-iters": 2 * ITERS}
        runs[name] = base_argv(corpus, cache, **long)
        # The first half stops at iteration 5 (--exit-interval) with a checkpoint there.
        runs[f"{name}-first-half"] = base_argv(corpus, cache, **long, **{
            "--save": save, "--save-interval": 2 * ITERS, "--exit-interval": ITERS})
        runs[f"{name}-resumed"] = base_argv(corpus, cache, **long, **{"--load": save})
    return runs


@pytest.fixture(scope="module")
def spawn(corpus, cache, tmp_path_factory):
    """world size -> every rank's results of that world's runs (spawned once, on demand)."""
    done: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in done:
            save_root = get.save_roots[world] = str(tmp_path_factory.mktemp(f"save{world}"))
            runs = runs_for(world, corpus, cache, save_root) if world > 1 else {
                "reference": base_argv(corpus, cache, **{"--train-iters": 2 * ITERS}),
                "reference-llama": base_argv(corpus, cache, **training_utils.LLAMA_FLAGS)}
            done[world] = run_distributed(_train_all, world, runs, timeout=400.0)
        return done[world]
    get.save_roots = {}
    return get


@pytest.fixture(scope="module")
def reference(spawn):
    return _reference(spawn, "reference")


def _reference(spawn, name: str) -> dict:
    run = spawn(1)[0][name]
    losses = [loss for loss, *_ in run["steps"]]
    assert losses[-1] < losses[0], "the reference run does not learn"
    params_norms = [norm for *_, norm in run["steps"]]
    assert params_norms[0] > 1.0 and params_norms[-1] != params_norms[0]
    assert len(run["evaluations"]) == (2 if name == "reference" else 1)  # at 5 and 10
    return run


def assert_close_runs(got: list, expected: list, rel: float = 1e-5) -> None:
    assert len(got) == len(expected) > 0
    for i, (g, e) in enumerate(zip(got, expected)):
        for a, b in zip(g if isinstance(g, tuple) else (g,), e if isinstance(e, tuple) else (e,)):
            assert math.isclose(a, b, rel_tol=rel), (i, got, expected)


def results(spawn, name: str) -> list[dict]:
    world = ALL_LAYOUTS[name.removesuffix("-resumed").removesuffix("-first-half")][0]
    return [rank_results[name] for rank_results in spawn(world)]


@pytest.mark.parametrize("name", list(ALL_LAYOUTS))
def test_layout_matches_one_process(spawn, reference, name):
    if name in LLAMA_LAYOUTS:
        reference = _reference(spawn, "reference-llama")
    ranks = results(spawn, name)
    for other in ranks[1:]:  # every rank reports the same reduced loss and norm
        assert other["steps"] == ranks[0]["steps"]
        assert other["evaluations"] == ranks[0]["evaluations"]
    assert_close_runs(ranks[0]["steps"][:ITERS], reference["steps"][:ITERS])
    assert_close_runs(ranks[0]["evaluations"][:1], reference["evaluations"][:1])


@pytest.mark.parametrize("name", list(LAYOUTS) + [f"{n}-{part}" for n in RESUMED
                                                   for part in ("first-half", "resumed")])
def test_tied_embedding_copies_stay_identical(spawn, name):
    ranks = results(spawn, name)
    pp = ranks[0]["pp"]
    holders = {}
    for r in ranks:
        tp_rank, pp_rank, dp_rank = r["coords"]
        if pp_rank in (0, pp - 1):
            holders.setdefault((tp_rank, dp_rank), {})[pp_rank] = r["digests"]
    steps = len(ranks[0]["steps"])
    for (tp_rank, dp_rank), copies in holders.items():
        first, last = copies[0], copies[pp - 1]
        assert len(first) == steps * micro_batches_per_step(name) + 1  # + the final weights
        assert len(set(first)) >= steps, "the weights should change every step"
        assert first == last, (tp_rank, dp_rank)


def micro_batches_per_step(name: str) -> int:
    """Forward calls per step on a stage holding the embedding: micro-batches x chunks."""
    world, flags = LAYOUTS[name.removesuffix("-resumed").removesuffix("-first-half")]
    dp = world // (flags.get("--tensor-model-parallel-size", 1)
                   * flags["--pipeline-model-parallel-size"])
    chunks = 2 if "--num-layers-per-virtual-pipeline-stage" in flags else 1
    return 8 // (2 * dp) * chunks


@pytest.mark.parametrize("name", RESUMED)
def test_resume_is_bit_exact(spawn, name):
    for straight, first, resumed in zip(results(spawn, name),
                                        results(spawn, f"{name}-first-half"),
                                        results(spawn, f"{name}-resumed")):
        assert len(straight["steps"]) == 2 * ITERS
        assert first["steps"] == straight["steps"][:ITERS]
        assert resumed["steps"] == straight["steps"][ITERS:]
        assert resumed["evaluations"] == straight["evaluations"][1:]
        # The weights too: the resumed run starts from the saved step and follows exactly.
        assert resumed["digests"] == straight["digests"][ITERS * micro_batches_per_step(name):]


@pytest.mark.parametrize("name,folders,chunks", [
    ("pp2", ["mp_rank_00_000", "mp_rank_00_001"], ["model"]),
    ("pp4-vp2", [f"mp_rank_00_{p:03d}" for p in range(4)], ["model0", "model1"]),
])
def test_checkpoint_has_a_folder_per_stage(spawn, name, folders, chunks):
    import torch

    results(spawn, name)
    root = os.path.join(spawn.save_roots[LAYOUTS[name][0]], name)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)
    iteration_dir = os.path.join(root, f"iter_{ITERS:07d}")
    assert sorted(os.listdir(iteration_dir)) == ["manifest.json", *folders]
    for stage, folder in enumerate(folders):
        state = torch.load(os.path.join(iteration_dir, folder, "model_optim_rng.pt"),
                           map_location="cpu", weights_only=False)
        assert [k for k in chunks if k in state] == chunks
        layers = {key.split(".")[2] for chunk in chunks for key in state[chunk]
                  if key.startswith("encoder.layers.")}
        assert len(layers) == 8 // len(folders) // len(chunks)  # layers numbered per chunk
        holds = {chunk: any(k.endswith("word_embeddings.weight") for k in state[chunk])
                 for chunk in chunks}
        expected_tied = {chunk: (stage == 0 and i == 0)
                         or (stage == len(folders) - 1 and i == len(chunks) - 1)
                         for i, chunk in enumerate(chunks)}
        assert holds == expected_tied


def test_log_bubble_prints_measured_and_theoretical(spawn):
    lines = results(spawn, "pp4-vp2")[0]["bubble_lines"]  # rank 0 prints, --log-interval 1
    assert len(lines) == 2 * ITERS
    # p = 4 stages, m = 8 / 2 = 4 micro-batches, v = 2 chunks: 3 / (2 * 4 + 3).
    assert all("theoretical 27.3% (p=4, m=4, v=2)" in line for line in lines)
    assert all(line.count("stage ") == 4 for line in lines)
    for line in lines:
        measured = float(line.split("measured ")[1].split("%")[0])
        assert 0.0 < measured < 100.0
    assert results(spawn, "pp4")[0]["bubble_lines"] == []  # only with --log-bubble


@pytest.mark.parametrize("name,layers", [
    ("pp2-uneven", [[[1, 2, 3]], [[4, 5, 6, 7, 8]]]),
    ("pp4", [[[1, 2]], [[3, 4]], [[5, 6]], [[7, 8]]]),
    ("pp4-vp2", [[[1], [5]], [[2], [6]], [[3], [7]], [[4], [8]]]),  # chunk c of stage i: c*4+i
])
def test_each_stage_builds_its_layers(spawn, name, layers):
    assert [r["layers"] for r in results(spawn, name)] == layers


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_log_line_has_throughput(spawn, name):
    ranks = results(spawn, name)
    assert len(ranks[0]["throughput_lines"]) == len(ranks[0]["steps"])  # rank 0 logs
    assert all(r["throughput_lines"] == [] for r in ranks[1:])
