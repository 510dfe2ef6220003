"""megatron.config: Megatron flag sets -> RunConfig, and every cross check names its flags."""

import pickle
import re

import pytest
import torch

from megatron.config import (
    ConfigError,
    DeepSpeedConfig,
    RunConfig,
    build_parser,
    flatten_config,
    parse_args,
    parse_args_or_exit,
    print_config,
    split_pipeline_layers,
    unmapped_flags,
)

# A tiny valid run; tests append flags (argparse keeps the last value of a repeated flag).
BASE = (
    "--num-layers 4 --hidden-size 16 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 100"
).split()

# examples/pretrain_gpt.sh (the "345M" model) of Megatron-LM / Megatron-DeepSpeed.
GPT2_345M = """
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --micro-batch-size 4 --global-batch-size 8 --seq-length 1024 --max-position-embeddings 1024
    --train-iters 500000 --lr-decay-iters 320000
    --save /ckpt/gpt2 --load /ckpt/gpt2 --data-path /data/my-gpt2_text_document
    --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --data-impl mmap --split 949,50,1
    --distributed-backend nccl --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine
    --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --checkpoint-activations
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --fp16
""".split()

# GPT-3 175B (examples/pretrain_gpt3_175B.sh) laid out on 64 ranks: tp 8 x pp 8.
GPT3_175B = """
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96
    --seq-length 2048 --max-position-embeddings 2048
    --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 32 32 1953125
    --train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine
    --log-interval 10 --eval-iters 40 --eval-interval 1000
    --data-path 0.2 /data/d1 0.3 /data/d2 0.5 /data/d3
    --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
    --save-interval 1000 --save /ckpt --load /ckpt --split 98,2,0
    --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.006 --tensorboard-dir /tb --fp16 --checkpoint-activations
    --sequence-parallel --use-distributed-optimizer
""".split()


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def parse(*flags: str, world_size: int = 1, **kwargs) -> RunConfig:
    return parse_args([*BASE, *flags], world_size=world_size, **kwargs)


def error_of(argv, world_size: int = 1, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(list(argv), world_size=world_size, **kwargs)
    return str(info.value)


def assert_names(message: str, *needles: str) -> None:
    for needle in needles:
        assert needle in message, f"{needle!r} not in error: {message}"


# ----------------------------------------------------------------------------- real flag sets


def test_gpt2_345m_example_flags():
    c = parse_args(GPT2_345M, world_size=1)
    m = c.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (24, 1024, 16)
    assert (m.seq_length, m.max_position_embeddings) == (1024, 1024)
    assert (m.ffn_hidden_size, m.kv_channels) == (4096, 64)
    assert m.fp16 and not m.bf16 and m.params_dtype == torch.float16
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full", "uniform", 1)
    assert m.padded_vocab_size == 50304  # GPT-2's 50257 padded to a multiple of 128
    t = c.training
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (4, 8, 500000)
    assert t.train_samples is None and c.num_microbatches == 2
    assert t.distributed_backend == ("nccl" if torch.cuda.is_available() else "gloo")
    s, o = c.scheduler, c.optimizer
    assert (s.lr_decay_iters, s.lr_decay_style, s.lr_warmup_fraction) == (320000, "cosine", 0.01)
    assert (o.lr, o.min_lr, o.weight_decay, o.clip_grad) == (1.5e-4, 1e-5, 0.01, 1.0)
    assert o.fp16 and o.initial_loss_scale == 2.0**32 and o.loss_scale is None
    d = c.data
    assert d.data_path == ("/data/my-gpt2_text_document",)
    assert d.blend == (("/data/my-gpt2_text_document",), None)
    assert d.split_fractions == pytest.approx((0.949, 0.050, 0.001))
    assert (d.vocab_file, d.merge_file, d.tokenizer_type) == (
        "gpt2-vocab.json", "gpt2-merges.txt", "GPT2BPETokenizer")
    assert (c.checkpoint.save, c.checkpoint.load, c.checkpoint.save_interval) == (
        "/ckpt/gpt2", "/ckpt/gpt2", 10000)
    assert (c.logging.log_interval, t.eval_interval, t.eval_iters) == (100, 1000, 10)
    assert c.parallel.world_size == 1 and c.data_parallel_size == 1


def test_gpt3_175b_on_64_ranks():
    c = parse_args(GPT3_175B, world_size=64)
    p = c.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 8)
    assert p.data_parallel_size == 1 and p.sequence_parallel
    assert c.optimizer.use_distributed_optimizer
    assert c.model.tensor_model_parallel_size == 8 and c.model.sequence_parallel
    assert c.pipeline_stage_num_layers == (12,) * 8
    assert c.model.padded_vocab_size == 51200  # 50257 up to a multiple of 128 x 8
    assert c.model.init_method_std == 0.006
    t = c.training
    assert t.rampup_batch_size == (32, 32, 1953125)
    assert (t.train_samples, t.train_iters, t.global_batch_size) == (146484375, None, 1536)
    assert c.num_microbatches == 1536
    assert (c.scheduler.lr_decay_samples, c.scheduler.lr_warmup_samples) == (126953125, 183105)
    assert c.optimizer.adam_beta2 == 0.95
    assert c.data.blend == (("/data/d1", "/data/d2", "/data/d3"), (0.2, 0.3, 0.5))
    assert c.data.split_fractions == pytest.approx((0.98, 0.02, 0.0))
    assert c.logging.tensorboard_dir == "/tb"


def test_gpt3_175b_interleaved_virtual_pipeline():
    c = parse_args([*GPT3_175B, "--num-layers-per-virtual-pipeline-stage", "4"], world_size=64)
    assert c.parallel.virtual_pipeline_model_parallel_size == 3  # 96 / 8 stages / 4 per chunk


def test_deepspeed_flags_need_deepspeed():
    # Without --deepspeed they would train with another engine than asked: each is refused.
    for flags in (["--deepspeed_config", "ds.json"], ["--deepspeed-config", "ds.json"],
                  ["--zero-stage", "1"], ["--deepspeed-activation-checkpointing"],
                  ["--no-pipeline-parallel"], ["--partition-activations"]):
        assert_names(error_of([*BASE, *flags]), flags[0].replace("-config", "_config"),
                     "add --deepspeed")
    assert parse().deepspeed == DeepSpeedConfig()
    assert parse("--deepspeed", "--zero-stage", "2").deepspeed.zero_stage == 2


# ----------------------------------------------------------------------------- defaults, aliases


def test_defaults_follow_megatron():
    c = parse()
    assert c.model.max_position_embeddings == 32  # = --seq-length
    assert c.training.global_batch_size == 2  # = micro x data-parallel
    assert (c.training.eval_interval, c.training.eval_iters, c.logging.log_interval) == (
        1000, 100, 100)
    assert (c.training.seed, c.model.seed) == (1234, 1234)  # the model receives the seed
    # Megatron-DeepSpeed's spelling: index-cache names hash the string.
    assert (c.data.split, c.data.num_workers, c.data.data_impl) == ("969, 30, 1", 2, "mmap")
    assert c.model.recompute_granularity is None and c.model.recompute_num_layers is None
    o = c.optimizer
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad) == (
        0.9, 0.999, 1e-8, 0.01, 1.0)
    assert (o.min_loss_scale, o.loss_scale_window, o.hysteresis) == (1.0, 1000, 2)
    assert c.scheduler.lr_decay_style == "linear"
    assert c.data.vocab_size == 100  # NullTokenizer's --vocab-size (the model's, once built)


def test_world_size_from_argument_then_env_then_one(monkeypatch):
    assert parse_args(BASE).parallel.world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    c = parse_args([*BASE, "--global-batch-size", "8"])
    assert c.parallel.world_size == 4 and c.data_parallel_size == 4
    assert parse_args(BASE, world_size=2).parallel.world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "four")
    assert_names(error_of(BASE, world_size=None), "WORLD_SIZE", "four")


def test_old_and_fork_aliases_map_to_one_field():
    c = parse("--vocab", "v.json", "--activations-checkpoint-method", "block",
              "--checkpoint-activations", "--checkpoint-num-layers", "2",
              "--override-lr-scheduler")
    assert c.data.vocab_file == "v.json"
    assert (c.model.recompute_granularity, c.model.recompute_method) == ("full", "block")
    assert c.model.recompute_num_layers == 2
    assert c.scheduler.override_opt_param_scheduler
    c = parse("--use-checkpoint-lr-scheduler", "--recompute-activations")
    assert c.scheduler.use_checkpoint_opt_param_scheduler
    assert c.model.recompute_granularity == "selective"
    for alias in ("PretrainedFromHF", "HFTokenizer", "HuggingFaceTokenizer"):
        c = parse("--tokenizer-type", alias, "--tokenizer-name-or-path", "gpt2")
        assert c.data.tokenizer_type == "PretrainedFromHF"
    assert parse("--tokenizer-type", "HFTokenizer", "--tokenizer-model", "m").data \
        .tokenizer_name_or_path == "m"


def test_model_switches():
    c = parse("--openai-gelu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
              "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--use-flash-attn")
    m = c.model
    assert m.activation == "gelu_tanh" and not m.add_bias_linear
    assert m.untie_embeddings_and_output_weights and m.use_flash_attn
    assert (m.position_embedding_type, m.rotary_percent) == ("rope", 0.5)
    assert parse("--gelu-tanh").model.activation == "gelu_tanh"
    assert parse().model.activation == "gelu"


def test_bf16_reduces_gradients_in_fp32():
    c = parse("--bf16")
    assert c.model.bf16 and c.model.params_dtype == torch.bfloat16
    assert c.optimizer.bf16 and c.optimizer.accumulate_allreduce_grads_in_fp32


def test_launcher_local_rank_and_no_op_flags_are_tolerated():
    for flags in (["--local_rank", "3"], ["--local_rank=3"], ["--local-rank", "3"]):
        assert parse(*flags).training.micro_batch_size == 2
    c = parse("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
              "--no-gradient-accumulation-fusion", "--use-mcore-models",
              "--fp32-residual-connection", "--distribute-checkpointed-activations",
              "--checkpoint-activations")
    assert c.model.recompute_granularity == "full"
    assert not c.optimizer.gradient_accumulation_fusion
    assert parse().optimizer.gradient_accumulation_fusion
    assert_names(error_of([*BASE, "--use-checkpoint-args"]), "--use-checkpoint-args",
                 "needs --load")
    assert_names(error_of([*BASE, "--wandb-exp-name", "p"]), "--wandb-exp-name",
                 "need --wandb-project")


def test_run_management_and_compatibility_flags():
    c = parse("--no-persist-layer-norm", "--no-scatter-gather-tensors-in-pipeline",
              "--use-contiguous-buffers-in-local-ddp", "--overlap-param-gather",
              "--overlap-p2p-comm", "--log-memory-to-tensorboard", "--num-experts", "1",
              "--ckpt-format", "torch", "--exit-on-missing-checkpoint",
              "--empty-unused-memory-level", "2", "--manual-gc", "--manual-gc-interval", "10",
              "--no-manual-gc-eval", "--no-log-loss-scale-to-tensorboard",
              "--log-world-size-to-tensorboard")
    t, ck, log = c.training, c.checkpoint, c.logging
    assert (t.empty_unused_memory_level, t.manual_gc, t.manual_gc_interval,
            t.manual_gc_eval) == (2, True, 10, False)
    assert ck.exit_on_missing_checkpoint and ck.ckpt_format == "torch"
    assert not log.log_loss_scale_to_tensorboard and log.log_world_size_to_tensorboard
    d = parse()
    assert (d.training.manual_gc, d.training.manual_gc_eval, d.training.empty_unused_memory_level,
            d.logging.log_loss_scale_to_tensorboard) == (False, True, 0, True)
    assert_names(error_of([*BASE, "--num-experts", "8", "--moe-router-topk", "9"]),
                 "--moe-router-topk (9)", "--num-experts (8)")
    assert parse("--ckpt-format", "torch_dist").checkpoint.ckpt_format == "torch_dist"
    assert_names(error_of([*BASE, "--ckpt-format", "zarr"]), "--ckpt-format")
    assert_names(error_of([*BASE, "--empty-unused-memory-level", "3"]),
                 "--empty-unused-memory-level")
    assert_names(error_of([*BASE, "--manual-gc-interval", "-1"]), "--manual-gc-interval")
    assert parse("--train-tokens", "1000").training.train_tokens == 1000
    assert_names(error_of([*BASE, "--train-tokens", "0"]), "--train-tokens")


def test_sequence_parallel_is_silently_off_at_tp1():
    c = parse("--sequence-parallel")
    assert not c.parallel.sequence_parallel and not c.model.sequence_parallel
    c = parse("--sequence-parallel", "--tensor-model-parallel-size", "2", world_size=2)
    assert c.parallel.sequence_parallel and c.model.sequence_parallel


def test_weight_decay_increment():
    c = parse("--weight-decay", "0.1")  # constant: the schedule uses --weight-decay itself
    assert (c.scheduler.start_weight_decay, c.scheduler.end_weight_decay) == (None, None)
    c = parse("--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0",
              "--end-weight-decay", "0.1")
    assert (c.scheduler.start_weight_decay, c.scheduler.end_weight_decay) == (0.0, 0.1)
    assert_names(error_of([*BASE, "--weight-decay-incr-style", "cosine"]),
                 "--weight-decay-incr-style cosine", "--start-weight-decay", "--end-weight-decay")
    assert_names(error_of([*BASE, "--start-weight-decay", "0.1"]), "--start-weight-decay",
                 "--weight-decay-incr-style")


def test_uneven_pipeline_split():
    c = parse("--num-layers", "10", "--pipeline-model-parallel-size", "4",
              "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers",
              "3", world_size=4, **{})
    assert c.pipeline_stage_num_layers == (1, 3, 3, 3)
    assert split_pipeline_layers(10, 4, None, 4) == (2, 2, 2, 4)
    assert split_pipeline_layers(7, 2, 3, 4) == (3, 4)


def test_with_vocab_size_returns_a_new_config():
    c = parse_args(GPT2_345M, world_size=1)
    c2 = c.with_vocab_size(50000)
    assert c2.model.vocab_size == 50000 and c.model.vocab_size == 50257
    assert c2.model.padded_vocab_size == 50048 and c2.training == c.training


def test_extra_args_provider_and_defaults():
    def provider(parser):
        group = parser.add_argument_group("mine")
        group.add_argument("--my-flag", type=int, default=7)
        return parser

    c = parse("--my-flag", "3", extra_args_provider=provider)
    assert c.extra == {"my_flag": 3}
    assert parse(extra_args_provider=provider).extra == {"my_flag": 7}

    def no_training_needed(parser):
        parser.set_defaults(train_iters=1, mock_data=True)
        return parser

    argv = [a for a in BASE if a not in ("--train-iters", "10", "--mock-data")]
    assert parse_args(argv, no_training_needed, 1).training.train_iters == 1
    c = parse_args(argv, world_size=1, defaults={"train_iters": 5, "mock_data": True})
    assert c.training.train_iters == 5 and c.data.mock_data
    assert parse_args([*argv, "--train-iters", "9"], world_size=1,
                      defaults={"train_iters": 5, "mock_data": True}).training.train_iters == 9
    assert_names(error_of(BASE, defaults={"not_a_flag": 1}), "not_a_flag")
    assert parse_args(argv, world_size=1, require_training=False).training.train_iters is None


def test_nonfinite_guard_flags():
    # On by default as in Megatron-LM, whose spelling to turn it off is the --no- one.
    c = parse()
    assert c.optimizer.check_for_nan_in_loss_and_grad is True
    assert c.training.max_consecutive_nonfinite_iterations == 10
    assert parse("--no-check-for-nan-in-loss-and-grad").optimizer.check_for_nan_in_loss_and_grad \
        is False
    assert parse("--check-for-nan-in-loss-and-grad").optimizer.check_for_nan_in_loss_and_grad
    assert parse("--max-consecutive-nonfinite-iterations", "1").training \
        .max_consecutive_nonfinite_iterations == 1
    assert "--max-consecutive-nonfinite-iterations" in error_of(
        [*BASE, "--max-consecutive-nonfinite-iterations", "0"])


def test_every_flag_lands_in_a_config_field():
    assert unmapped_flags() == []


def test_config_pickles_for_spawned_ranks():
    c = parse_args(GPT3_175B, world_size=64)
    assert pickle.loads(pickle.dumps(c)) == c
    d = c.to_dict()
    assert d["model"]["fp16"] and d["training"]["global_batch_size"] == 1536
    assert c.model.params_dtype == torch.float16


# ----------------------------------------------------------------------------- printing


def test_print_config_megatron_block():
    c = parse_args(GPT2_345M, world_size=1)
    printed = []
    text = print_config(c, printed.append)
    assert printed == [text]
    lines = text.splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    names = [line.split()[0] for line in body]
    assert names == sorted(names, key=str.lower) and len(names) == len(set(names))
    assert "  num_layers " + "." * (48 - len("num_layers")) + " 24" in body
    assert any(re.fullmatch(r"  lr \.+ 0\.00015", line) for line in body)
    assert "  data_parallel_size " + "." * 30 + " 1" in body
    assert set(flatten_config(c)) == set(names)


def test_print_config_only_on_rank_zero(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    printed = []
    text = print_config(parse(), printed.append)
    assert printed == [] and "arguments" in text


# ----------------------------------------------------------------------------- errors


def test_unknown_flag_is_named_with_a_suggestion():
    message = error_of([*BASE, "--num-layer", "3"])
    assert_names(message, "unrecognized", "--num-layer", "did you mean --num-layers")
    assert_names(error_of([*BASE, "--bogus-thing=1"]), "--bogus-thing")


def test_peers_spellings_of_our_features_are_accepted(capsys):
    plain = parse()
    rope = parse(*"--position-embedding-type rope --rotary-base 500000".split())
    assert parse(*"--use-rotary-position-embeddings --rope-theta 500000".split()) == rope
    assert parse(*"--use-rotary-position-embeddings --rotary-position-embeddings-theta "
                 "500000".split()) == rope
    assert parse("--norm-epsilon", "1e-6").model.layernorm_epsilon == 1e-6
    assert parse(*"--encoder-num-layers 6 --encoder-seq-length 64".split()).model \
        == parse(*"--num-layers 6 --seq-length 64".split()).model
    assert parse("--use-dist-ckpt").checkpoint.ckpt_format == "torch_dist"
    assert parse(*"--dist-ckpt-format torch_dist".split()).checkpoint.ckpt_format == "torch_dist"
    assert parse("--no-mmap-bin-files").data.in_memory
    assert parse("--use-flash-attn-triton").model.use_flash_attn
    assert parse(*"--normalization layernorm".split()) == plain
    assert parse(*"--normalization LayerNorm".split()) == plain
    capsys.readouterr()
    no_ops = parse(*"--transformer-impl transformer_engine --DDP-impl local --no-rope-fusion "
                   "--overlap-p2p-communication --auto-detect-ckpt-format".split())
    assert no_ops == plain
    said = capsys.readouterr().out
    for given in ("--transformer-impl transformer_engine", "--DDP-impl local", "--no-rope-fusion",
                  "--overlap-p2p-communication", "--auto-detect-ckpt-format"):
        assert f"> {given} is accepted for compatibility and has no effect" in said, given


def test_llama_flags_in_both_peers_spellings():
    """Megatron-LM's Llama script flags and Megatron-DeepSpeed's pretrain_llama2 ones give the
    same model; wrong group counts are refused with the numbers."""
    mlm = parse(*("--position-embedding-type rope --normalization RMSNorm --swiglu "
                  "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-"
                  "weights --disable-bias-linear --ffn-hidden-size 64").split()).model
    mds = parse(*("--use-rotary-position-embeddings --normalization rmsnorm --swiglu "
                  "--num-key-value-heads 2 --untie-embeddings-and-output-weights "
                  "--disable-bias-linear --ffn-hidden-size 64").split()).model
    assert mlm == mds
    assert (mlm.normalization, mlm.query_groups, mlm.group_query_attention) == \
        ("RMSNorm", 2, True)
    assert mlm.kv_projection_size == 2 * mlm.kv_channels
    plain = parse().model
    assert (plain.query_groups, plain.num_query_groups, plain.group_query_attention) == \
        (4, None, False)
    assert parse(*"--hidden-size 96 --swiglu".split()).model.ffn_hidden_size == 256  # 8/3 h
    assert_names(error_of([*BASE, "--num-query-groups", "3"]), "--num-attention-heads (4)",
                 "--num-query-groups (3)")
    assert_names(error_of([*BASE, "--num-query-groups", "1", "--tensor-model-parallel-size",
                           "2"], world_size=2), "--num-query-groups (1)",
                 "--tensor-model-parallel-size (2)")
    assert_names(error_of([*BASE, "--normalization", "BatchNorm"]), "--normalization",
                 "BatchNorm")
    assert_names(error_of([*BASE, "--swiglu"]), "--swiglu's default --ffn-hidden-size")
    assert parse("--no-position-embedding").model.position_embedding_type == "none"


@pytest.mark.parametrize("flags, said", [
    ("--squared-relu", "--squared-relu: not supported yet (squared-ReLU feed-forward "
     "layers)"),
    ("--qk-layernorm", "--qk-layernorm: not supported yet (layer norms on queries and keys)"),
    ("--moe-permute-fusion", "--moe-permute-fusion: not supported yet "
     "(this mixture-of-experts option"),
    ("--fp8-format hybrid", "--fp8-format: not supported yet (FP8 training"),
])
def test_flags_of_features_we_lack_say_so_instead_of_guessing(flags, said):
    message = error_of([*BASE, *flags.split()])
    assert said in message and "did you mean" not in message, message


def test_a_typo_next_to_a_missing_feature_gets_both_answers():
    message = error_of([*BASE, "--qk-layernorm", "--hiden-size", "8"])
    assert message == ("--qk-layernorm: not supported yet (layer norms on queries and keys); "
                       "unrecognized arguments: --hiden-size (did you mean --hidden-size?)")
    # Another feature's flag is not offered as the answer to a flag we do not know (at the
    # old cut-off this was "did you mean --log-timers-to-tensorboard?").
    assert "did you mean" not in error_of([*BASE, "--log-optimizer-states-to-tensorboard"])


def test_bad_value_names_the_flag():
    assert_names(error_of([*BASE, "--num-layers", "two"]), "--num-layers", "two")
    assert_names(error_of([*BASE, "--lr-decay-style", "wild"]), "--lr-decay-style", "wild")
    assert_names(error_of([*BASE, "--tokenizer-type", "Foo"]), "--tokenizer-type", "Foo")


def test_entry_point_exits_with_status_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit([*BASE, "--num-layer", "3"], world_size=1)
    assert info.value.code == 2
    assert "error: unrecognized arguments: --num-layer" in capsys.readouterr().err


def test_missing_required_flags_are_all_named():
    message = error_of(["--mock-data", "--train-iters", "1", "--tokenizer-type", "NullTokenizer",
                        "--vocab-size", "8"])
    assert_names(message, "--num-layers", "--hidden-size", "--num-attention-heads",
                 "--seq-length", "--micro-batch-size")
    no_length = [a for a in BASE if a not in ("--train-iters", "10")]
    assert_names(error_of(no_length), "--train-iters or --train-samples")
    no_data = [a for a in BASE if a != "--mock-data"]
    assert_names(error_of(no_data), "--data-path", "--mock-data")
    # Real data needs the tokenizer's files (mock data alone does not: see below).
    gpt2 = [a for a in BASE if a not in ("NullTokenizer", "--tokenizer-type", "--mock-data")]
    assert_names(error_of([*gpt2, "--data-path", "corpus"]), "--vocab-file", "--merge-file",
                 "GPT2BPETokenizer")
    assert_names(error_of([*BASE, "--tokenizer-type", "HFTokenizer"]), "--tokenizer-name-or-path")


def test_global_batch_not_divisible_names_the_three_numbers():
    message = error_of([*BASE, "--global-batch-size", "12"], world_size=4)
    assert_names(message, "--global-batch-size (12)", "--micro-batch-size (2)",
                 "data-parallel size (4)")


def test_layers_not_divisible_by_pipeline():
    message = error_of([*BASE, "--num-layers", "10", "--pipeline-model-parallel-size", "4"],
                       world_size=4)
    assert_names(message, "--num-layers (10)", "--pipeline-model-parallel-size (4)")


def test_uneven_split_inconsistent():
    pp4 = [*BASE, "--num-layers", "10", "--pipeline-model-parallel-size", "4"]
    message = error_of([*pp4, "--decoder-first-pipeline-num-layers", "2",
                        "--decoder-last-pipeline-num-layers", "3"], world_size=4)
    assert_names(message, "--decoder-first-pipeline-num-layers (2)",
                 "--decoder-last-pipeline-num-layers (3)", "--num-layers (10)", "5 layers")
    message = error_of([*BASE, "--decoder-first-pipeline-num-layers", "1"])
    assert_names(message, "--decoder-first-pipeline-num-layers",
                 "--pipeline-model-parallel-size > 1")
    message = error_of([*BASE, "--pipeline-model-parallel-size", "2",
                        "--decoder-first-pipeline-num-layers", "1",
                        "--decoder-last-pipeline-num-layers", "2"], world_size=2)
    assert_names(message, "--num-layers (4)")


def test_world_size_not_divisible_by_tp_times_pp():
    message = error_of([*BASE, "--tensor-model-parallel-size", "4"], world_size=6)
    assert_names(message, "world size (6)", "--tensor-model-parallel-size (4)",
                 "--pipeline-model-parallel-size (1)")


def test_rampup_needs_sample_based_training():
    message = error_of([*BASE, "--rampup-batch-size", "2", "2", "100"])
    assert_names(message, "--rampup-batch-size", "--train-iters (10)")
    samples = [a for a in BASE if a not in ("--train-iters", "10")] + ["--train-samples", "100"]
    message = error_of([*samples, "--global-batch-size", "8", "--rampup-batch-size", "2", "4",
                        "100"])
    assert_names(message, "--rampup-batch-size", "--global-batch-size (8)", "START (2)",
                 "INCREMENT (4)")
    assert_names(error_of([*samples, "--rampup-batch-size", "2", "x", "1"]),
                 "--rampup-batch-size", "'x'")


def test_fp16_with_bf16():
    assert_names(error_of([*BASE, "--fp16", "--bf16"]), "--fp16", "--bf16")


def test_heads_not_divisible_by_tensor_parallel():
    message = error_of([*BASE, "--num-attention-heads", "2", "--hidden-size", "16",
                        "--tensor-model-parallel-size", "4"], world_size=4)
    assert_names(message, "--num-attention-heads (2)", "--tensor-model-parallel-size (4)")


def test_virtual_pipeline_checks():
    pp4 = [*BASE, "--num-layers", "24", "--pipeline-model-parallel-size", "4"]
    message = error_of([*pp4, "--num-layers-per-virtual-pipeline-stage", "4"], world_size=4)
    assert_names(message, "--num-layers-per-virtual-pipeline-stage (4)", "--num-layers (24)",
                 "--pipeline-model-parallel-size (4)", "= 6")
    message = error_of([*BASE, "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1"], world_size=2)
    assert_names(message, "--num-layers-per-virtual-pipeline-stage",
                 "--pipeline-model-parallel-size > 2", "got 2")
    c = parse_args([*pp4, "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "8"],
                   world_size=4)
    assert c.parallel.virtual_pipeline_model_parallel_size == 3


def test_iteration_and_sample_schedules_do_not_mix():
    samples = [a for a in BASE if a not in ("--train-iters", "10")] + ["--train-samples", "100"]
    assert_names(error_of([*samples, "--lr-decay-iters", "5"]), "--lr-decay-iters (5)",
                 "--train-samples", "--lr-decay-samples")
    assert_names(error_of([*samples, "--lr-warmup-iters", "5"]), "--lr-warmup-iters (5)",
                 "--train-samples")
    assert_names(error_of([*BASE, "--lr-decay-samples", "50"]), "--lr-decay-samples (50)",
                 "--train-iters")
    assert_names(error_of([*BASE, "--train-samples", "100"]), "--train-iters (10)",
                 "--train-samples (100)")


def test_data_path_pairs_are_validated():
    assert_names(error_of([*BASE, "--data-path", "0.3", "a", "0.7"]), "--data-path", "3 values")
    assert_names(error_of([*BASE, "--data-path", "a", "0.3", "b", "0.7"]), "--data-path",
                 "weight 1", "'a'")
    assert_names(error_of([*BASE, "--data-path", "0.5", "a", "-0.5", "b"]), "--data-path",
                 "weight 2", "-0.5")
    assert_names(error_of([*BASE, "--data-path", "corpus_text_document.bin"]), "--data-path",
                 ".bin")
    assert_names(error_of([*BASE, "--train-data-path", "1", "a", "x", "b"]), "--train-data-path")
    c = parse("--data-path", "1", "a", "3", "b")
    assert c.data.blend == (("a", "b"), (1.0, 3.0))
    c = parse("--train-data-path", "t", "--valid-data-path", "0.5", "v1", "0.5", "v2")
    assert c.data.blend_per_split == ((("t",), None), (("v1", "v2"), (0.5, 0.5)), None)
    assert_names(error_of([*BASE, "--data-path", "a", "--train-data-path", "t"]),
                 "--data-path", "--train-data-path")


def test_split_is_validated():
    assert parse("--split", "969, 30, 1").data.split_fractions == pytest.approx(
        (0.969, 0.030, 0.001))
    assert parse("--split", "90,10").data.split_fractions == pytest.approx((0.9, 0.1, 0.0))
    assert_names(error_of([*BASE, "--split", "9,x,1"]), "--split", "9,x,1")


def test_recompute_checks():
    message = error_of([*BASE, "--recompute-granularity", "full"])
    assert_names(message, "--recompute-granularity full", "--recompute-method")
    message = error_of([*BASE, "--recompute-granularity", "selective",
                        "--recompute-method", "block"])
    assert_names(message, "--recompute-method (block)", "selective")
    message = error_of([*BASE, "--distribute-checkpointed-activations"])
    assert_names(message, "--distribute-checkpointed-activations", "--checkpoint-activations")
    message = error_of([*BASE, "--checkpoint-activations", "--recompute-num-layers", "5"])
    assert_names(message, "--recompute-num-layers (5)", "(4)")
    message = error_of([*BASE, "--checkpoint-activations", "--recompute-granularity",
                        "selective"])
    assert_names(message, "--checkpoint-activations", "selective")


def test_checkpoint_and_deepspeed_checks():
    assert parse("--save", "/ckpt").checkpoint.save_interval is None  # saved at the end only
    assert_names(error_of([*BASE, "--zero-stage", "4"]), "--zero-stage", "4")


def test_scheduler_and_optimizer_checks_name_flags():
    assert_names(error_of([*BASE, "--lr", "1e-4", "--min-lr", "1e-3"]), "--min-lr", "--lr")
    assert_names(error_of([*BASE, "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"]),
                 "--lr-warmup-fraction", "--lr-warmup-iters")
    assert_names(error_of([*BASE, "--override-opt_param-scheduler",
                           "--use-checkpoint-opt_param-scheduler"]),
                 "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")


def test_received_values_come_from_their_owner():
    from megatron.config import ModelConfig, ParallelConfig

    # Each value has one owner: the model's tensor-parallel size is the parallel slice's.
    c = RunConfig(model=ModelConfig(tensor_model_parallel_size=2),
                  parallel=ParallelConfig(world_size=2))
    assert c.model.tensor_model_parallel_size == 1
    c = RunConfig(parallel=ParallelConfig(world_size=2, tensor_model_parallel_size=2,
                                          sequence_parallel=True))
    assert c.model.tensor_model_parallel_size == 2 and c.model.sequence_parallel
    # Checks on a received value run with the owner's value and name the owner's flag.
    with pytest.raises(ConfigError) as info:
        RunConfig(model=ModelConfig(num_attention_heads=4),
                  parallel=ParallelConfig(world_size=8, tensor_model_parallel_size=8))
    assert_names(str(info.value), "--num-attention-heads (4)", "--tensor-model-parallel-size (8)")


def test_parser_help_lists_megatron_spellings():
    text = build_parser().format_help()
    for spelling in ("--override-opt_param-scheduler", "--deepspeed_config", "--local_rank",
                     "--num-layers-per-virtual-pipeline-stage", "--rampup-batch-size"):
        assert spelling in text


def test_mock_data_needs_no_tokenizer_files_and_srun_world_size(monkeypatch):
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data"]
    assert parse_args(argv, world_size=1).data.vocab_file is None
    with pytest.raises(ConfigError, match="--vocab-file"):
        parse_args([a for a in argv if a != "--mock-data"] + ["--data-path", "x"], world_size=1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert parse_args(argv + ["--tensor-model-parallel-size", "2"]).parallel.data_parallel_size == 2


@pytest.mark.parametrize("env,printed", [({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False),
                                         ({"SLURM_PROCID": "3"}, False)])
def test_a_flag_error_is_printed_by_global_rank_0_only(monkeypatch, capsys, env, printed):
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit([*BASE, "--num-layers", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("error: " in err and "--num-layers" in err) if printed else err == ""


def test_context_parallel_sizes_resolve_and_refusals_name_the_flags():
    """--context-parallel-size and --ds-sequence-parallel-size take ranks from the data-
    parallel size; what they cannot do is refused naming the flag and the numbers."""
    cfg = parse("--context-parallel-size", "2", "--attention-dropout", "0", world_size=8)
    assert (cfg.parallel.context_degree, cfg.data_parallel_size) == (2, 4)
    assert (cfg.model.context_parallel_size, cfg.model.context_attention) == (2, "p2p")
    cfg = parse("--ds-sequence-parallel-size", "4", world_size=8)
    assert (cfg.model.context_parallel_size, cfg.model.context_attention) == (4, "ulysses")
    assert_names(error_of([*BASE, "--context-parallel-size", "2"], world_size=2),
                 "--cp-comm-type p2p", "--attention-dropout 0 (got 0.1)")
    no_dropout = [*BASE, "--attention-dropout", "0"]
    assert_names(error_of([*no_dropout, "--context-parallel-size", "3"], world_size=3),
                 "--seq-length (32) is not divisible by 6", "--context-parallel-size (3)")
    assert_names(error_of([*no_dropout, "--context-parallel-size", "2"], world_size=3),
                 "world size (3)", "--context-parallel-size (2)")
    assert_names(error_of([*BASE, "--ds-sequence-parallel-size", "8"], world_size=8),
                 "--ds-sequence-parallel-size (8)", "the 4 heads of each tensor rank")
    assert_names(error_of([*no_dropout, "--context-parallel-size", "2",
                           "--ds-sequence-parallel-size", "2"], world_size=4),
                 "use one of them")
    assert_names(error_of([*no_dropout, "--context-parallel-size", "2",
                           "--reset-attention-mask"], world_size=2),
                 "--context-parallel-size (2) cannot be combined with --reset-attention-mask")
    assert_names(error_of([*BASE, "--ds-sequence-parallel-size", "2", "--deepspeed"],
                          world_size=2),
                 "--deepspeed without --no-pipeline-parallel")


def test_mixture_of_experts_flags():
    m = parse(*"--num-experts 4 --moe-router-topk 1 --moe-aux-loss-coeff 0.01 "
              "--moe-z-loss-coeff 0.001 --moe-expert-capacity-factor 1.5 "
              "--moe-token-drop-policy position --moe-pad-expert-input-to-capacity "
              "--moe-router-score-function sigmoid --moe-shared-expert-intermediate-size 32 "
              "--moe-router-load-balancing-type seq_aux_loss".split()).model
    assert (m.num_experts, m.moe_router_topk, m.moe_aux_loss_coeff, m.moe_z_loss_coeff,
            m.moe_expert_capacity_factor, m.moe_token_drop_policy,
            m.moe_pad_expert_input_to_capacity, m.moe_router_score_function,
            m.moe_shared_expert_intermediate_size, m.moe_router_load_balancing_type) == (
        4, 1, 0.01, 0.001, 1.5, "position", True, "sigmoid", 32, "seq_aux_loss")
    assert m.moe_ffn_hidden_size == m.ffn_hidden_size == 64 and m.moe_layers == (True,) * 4
    # Megatron-LM's layer rules: every Nth from the first, or a list; Megatron-DeepSpeed's
    # --expert-interval N (layers N, 2N, ... counted from 1) and --topk.
    assert parse("--num-experts", "2", "--moe-layer-freq", "2").model.moe_layers == (
        True, False, True, False)
    assert parse("--num-experts", "2", "--moe-layer-freq", "([1]*1+[0])*2").model.moe_layers \
        == (True, False, True, False)
    ds = parse(*"--num-experts 2 --expert-interval 2 --topk 1".split()).model
    assert ds.moe_layers == (False, True, False, True) and ds.moe_router_topk == 1
    dense = parse("--num-experts", "1", "--expert-interval", "2").model  # Megatron-DS dense
    assert dense.num_experts is None and dense.moe_layers == (False,) * 4


@pytest.mark.parametrize("flags, said", [
    ("--num-experts 4 --moe-router-topk 5", ("--moe-router-topk (5)", "--num-experts (4)")),
    ("--moe-aux-loss-coeff 0.1", ("--moe-aux-loss-coeff (0.1)", "needs --num-experts")),
    ("--num-experts 4 --moe-layer-freq [1,0]", ("--moe-layer-freq", "2 layers",
                                                 "--num-layers is 4")),
    ("--num-experts 4 --moe-layer-freq 1+", ("--moe-layer-freq", "neither a number")),
    ("--num-experts 4 --moe-pad-expert-input-to-capacity",
     ("--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor")),
    ("--num-experts 4 --moe-expert-capacity-factor 0", ("--moe-expert-capacity-factor",)),
    ("--num-experts 4 --moe-ffn-hidden-size 33 --tensor-model-parallel-size 2",
     ("--moe-ffn-hidden-size (33)", "--tensor-model-parallel-size (2)")),
    ("--moe-expert-parallel-size 2", ("--expert-model-parallel-size (2)",
                                      "needs --num-experts")),
    ("--num-experts 3 --expert-model-parallel-size 2", ("--num-experts (3)",
                                                        "--expert-model-parallel-size (2)")),
    ("--num-experts 4 --expert-model-parallel-size 4", ("--expert-model-parallel-size (4)",
                                                        "data-parallel size (2")),
    ("--num-experts 4 --expert-model-parallel-size 2 --tensor-model-parallel-size 2",
     ("--expert-model-parallel-size (2)", "data-parallel size (1",
      "--tensor-model-parallel-size 2")),
    ("--num-experts 4 --expert-model-parallel-size 2 --moe-expert-parallel-size 1",
     ("--expert-model-parallel-size (2)", "--moe-expert-parallel-size (1)", "disagree")),
    ("--num-experts 4 --expert-model-parallel-size 2 --context-parallel-size 2 "
     "--attention-dropout 0", ("--expert-model-parallel-size (2)", "--context-parallel-size")),
    ("--num-experts 4 --moe-token-dispatcher-type flex", ("--moe-token-dispatcher-type",)),
    # DeepSpeed-MoE's flags need --deepspeed; under it the built-in layer's are refused.
    ("--moe-loss-coeff 0.01", ("--moe-loss-coeff", "DeepSpeed-MoE", "add --deepspeed")),
    ("--disable-moe-token-dropping", ("--disable-moe-token-dropping", "add --deepspeed")),
    ("--num-experts 4 --deepspeed --no-pipeline-parallel --moe-aux-loss-coeff 0.01",
     ("--moe-aux-loss-coeff (0.01)", "built-in MoE layer's", "--moe-loss-coeff")),
    ("--num-experts 4 --deepspeed --no-pipeline-parallel --topk 3",
     ("--num-experts (4)", "--topk 3", "1 or 2")),
    ("--num-experts 4 --deepspeed", ("DeepSpeed-MoE", "--no-pipeline-parallel")),
    ("--num-experts 4 --deepspeed --no-pipeline-parallel --zero-stage 3",
     ("--zero-stage 3", "ZeRO 0-2")),
    ("--num-experts 4 --deepspeed", ("--num-experts (4)", "--deepspeed")),
    ("--num-experts 4 --context-parallel-size 2 --attention-dropout 0", ("--num-experts (4)",
                                                   "--context-parallel-size 2")),
])
def test_mixture_of_experts_refusals_name_the_flags(flags, said):
    assert_names(error_of([*BASE, *flags.split()], world_size=2), *said)
