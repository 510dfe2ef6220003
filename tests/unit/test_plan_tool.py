"""tools/plan.py on the GPT-3 175B recipe (64 ranks built on the meta device) and its errors."""

from __future__ import annotations

import pytest

from tests.distributed.training_utils import load_tool

GPT3_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
    "--global-batch-size", "1536", "--tensor-model-parallel-size", "8",
    "--pipeline-model-parallel-size", "8", "--fp16", "--sequence-parallel",
    "--use-distributed-optimizer", "--use-flash-attn", "--gpu-memory-gb", "80",
]


def test_gpt3_175b_exact_count_memory_bubble_and_flops(capsys):
    plan = load_tool("plan").main(GPT3_175B)
    out = capsys.readouterr().out
    L, h, V, P = 96, 12288, 51200, 2048  # V: GPT-2's 50257 padded to a multiple of 128 x 8
    assert plan.total_params == 12 * L * h**2 + 13 * L * h + V * h + P * h + 2 * h \
        == 174_615_846_912 == plan.closed_form_params
    assert "parameters: 174,615,846,912 in total" in out
    # Stage 0 (embeddings, 8 micro-batches in flight) is the fullest GPU: 52.6 GB of 80.
    assert [st.params_per_rank[0] for st in plan.stages] == \
        [2_822_731_776] + [2_718_922_752] * 6 + [2_797_590_528]
    assert plan.peak_memory == plan.stages[0].memory.total
    assert 52.5 < plan.peak_memory / 2**30 < 52.7 and plan.fits
    assert "peak memory per GPU: 52.58 GB of 80 GB: fits" in out
    assert plan.bubble_fraction == pytest.approx(7 / 1536)
    assert plan.flops_per_iteration == pytest.approx(3.3862e18, rel=1e-4)


def test_a_plan_that_does_not_fit_says_so_and_exits_1(capsys):
    tool = load_tool("plan")
    small_gpu = [*GPT3_175B[:-1], "40", "--zero-stage", "0"]
    plan = tool.main(small_gpu)
    assert plan.fits is False
    assert "of 40 GB: DOES NOT FIT" in capsys.readouterr().out


def test_zero_stages_shard_what_they_say(capsys):
    tool = load_tool("plan")
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "1", "--world-size", "4",
             "--bf16", "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer"]
    mem = [tool.main([*flags, "--zero-stage", str(z)]).stages[0].memory for z in range(4)]
    capsys.readouterr()
    assert mem[1].optimizer * 4 == mem[0].optimizer and mem[1].gradients == mem[0].gradients
    assert mem[2].gradients * 4 == mem[0].gradients and mem[2].weights == mem[0].weights
    assert mem[3].weights * 4 == mem[0].weights


def test_bad_flags_exit_2_naming_them(capsys):
    with pytest.raises(SystemExit) as stop:
        load_tool("plan").main(["--num-layers", "3", "--hidden-size", "64",
                                "--num-attention-heads", "4", "--seq-length", "32",
                                "--micro-batch-size", "1", "--pipeline-model-parallel-size",
                                "2"])
    assert stop.value.code == 2
    assert "--num-layers (3) is not divisible by --pipeline-model-parallel-size (2)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("experts", [(), ("--num-experts", "4", "--moe-expert-parallel-size", "2")],
                         ids=["dense", "experts"])
def test_pretrain_dry_run_prints_the_same_plan_and_trains_nothing(monkeypatch, capsys, experts):
    import pretrain_gpt

    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "1000", "--use-cpu", *experts]
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")  # as the launch would set it: data parallel 2
    state = pretrain_gpt.main([*flags, "--train-iters", "5", "--lr", "1e-3", "--dry-run"])
    dry = capsys.readouterr().out
    assert state.iteration == 0 and "iteration" not in dry.replace("per iteration", "")
    load_tool("plan").main([*flags, "--world-size", "8"])
    planned = capsys.readouterr().out
    assert "layout: tensor 2 x pipeline 2 x data 2 = 8 GPUs" in dry
    assert dry.strip().endswith(planned.strip())
    if experts:
        assert "expert parallel 2 within data (allgather)" in dry
        assert "active per token" in dry and "experts: 4 in each of 4 MoE layers" in dry


# The Llama recipes' models (examples/llama/) at their real sizes, Meta's vocabularies.
LLAMA2_7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--ffn-hidden-size", "11008", "--seq-length", "4096", "--vocab-size", "32000"]
LLAMA3_8B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size",
             "14336", "--seq-length", "8192", "--vocab-size", "128256"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--use-distributed-optimizer"]


@pytest.mark.parametrize("model, published", [(LLAMA2_7B, 6_738_415_616),
                                              (LLAMA3_8B, 8_030_261_248)])
def test_llama_sizes_count_exactly_and_their_flops_follow_the_swiglu_gqa_formula(
        capsys, model, published):
    """The planner's count equals the model built on the meta device and Meta's published
    count; FLOPs per token equal 2 x (every matrix's elements) + the attention scores, summed
    over the built model's own weights (an independent count of the formula)."""
    from megatron.config import parse_args
    from megatron.core import parallel_state
    from megatron.model.gpt_model import GPTModel
    from megatron.planning.flops import flops_per_token

    positions = ["--max-position-embeddings", model[model.index("--seq-length") + 1]]
    plan = load_tool("plan").main([*model, *LLAMA, *positions])
    capsys.readouterr()
    assert plan.total_params == plan.closed_form_params == published
    cfg = parse_args([*model, *LLAMA, *positions, "--train-iters", "1", "--mock-data",
                      "--tokenizer-type", "NullTokenizer"], world_size=1)
    cfg = cfg.with_vocab_size(cfg.data.vocab_size)
    parallel_state.destroy_model_parallel()
    built = GPTModel(cfg.model, device="meta")
    assert sum(p.numel() for p in built.parameters()) == published
    m = cfg.model
    matrices = sum(p.numel() for name, p in built.named_parameters()
                   if p.dim() == 2 and "word_embeddings" not in name)
    forward = 2 * matrices + m.num_layers * 4 * m.seq_length * m.projection_size
    assert flops_per_token(m) == 3 * forward


def test_context_parallelism_divides_the_activations_and_states_its_traffic(capsys):
    """At sequence 32K a Llama-style 6B shape on 64 GPUs: context parallelism 4 (taken from
    the data-parallel ranks) keeps a quarter of the tokens, so a quarter of the layers'
    activations, and the plan states the ring's bytes."""
    tool = load_tool("plan")
    flags = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "32768", "--max-position-embeddings", "32768",
             "--micro-batch-size", "1", "--global-batch-size", "64",
             "--tensor-model-parallel-size", "8", "--sequence-parallel", "--bf16",
             "--use-distributed-optimizer", "--attention-dropout", "0",
             "--group-query-attention", "--num-query-groups", "8", "--world-size", "64"]
    alone = tool.main(flags).stages[0].memory
    split = tool.main([*flags, "--context-parallel-size", "4"]).stages[0].memory
    out = capsys.readouterr().out
    assert split.activations * 4 == pytest.approx(alone.activations, rel=1e-6)
    assert (split.weights, split.optimizer) == (alone.weights, alone.optimizer)  # dp x cp = 8
    assert "tensor 8 x pipeline 1 x context 4 (p2p) x data 2 = 64 GPUs" in out
    # p2p: (4 (N-1) + 2N) x s/N x b x kv/t x 2 bytes = 20 x 8192 x 128 x 2 = 40 MiB.
    assert "8192 of 32768 tokens per rank; 40.00 MB sent per rank per layer" in out
