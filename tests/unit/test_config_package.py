"""The configuration package as a whole: one declaration per flag, accepted means used, and
TOML files equal to the flags they stand for."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Optional

import pytest

from megatron.config import (
    SLICE_CLASSES,
    ConfigError,
    RunConfig,
    build_parser,
    config_to_toml,
    parse_args,
)
from megatron.config.base import (
    Slice,
    check_refused,
    field_default,
    flags_of,
    option,
    option_fields,
)

REPO = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
        "--mock-data", "--lr", "1e-3"]

# ----------------------------------------------------------------------------- the flag surface


# Flags added since that list was taken, each for a capability of its own.
NEW_FLAGS = {
    "--config", "--dump-config",  # TOML files (issue 11)
    "--no-verify-checkpoint",  # checkpoint manifests (issue 13)
    "--log-all-ranks",  # every message once unless asked (issue 11)
    # The non-finite guard (issue 13): Megatron-LM's switch, both spellings, and its stop.
    "--check-for-nan-in-loss-and-grad", "--no-check-for-nan-in-loss-and-grad",
    "--max-consecutive-nonfinite-iterations",
    # Issue 15: token files read into RAM, offline wandb beside --wandb-project.
    "--in-memory", "--wandb-exp-name", "--wandb-save-dir",
    # Evaluate a checkpoint without training (issue 14); --skip-train is Megatron-LM's name.
    "--eval-only", "--skip-train",
    "--dry-run",  # the planner behind pretrain_gpt.py (issue 12)
    # Decentralized data parallelism with AccumAdamW (issue 15).
    "--dp-mode", "--dp-topology", "--accum-steps",
    "--dp-overlap",  # the neighbour exchange overlapped with forward/backward (issue 15)
    # DeepSpeed's activation checkpointing settings, Megatron-DeepSpeed's spellings (issue 12).
    "--partition-activations", "--contigious-checkpointing", "--checkpoint-in-cpu",
    "--synchronize-each-layer",
    "--compile",  # torch.compile of the transformer layers (issue 10)
    # Long sequences (issue 33): Megatron-LM's context parallelism, Megatron-DeepSpeed's
    # Ulysses (refused as missing features before).
    "--context-parallel-size", "--cp-comm-type", "--ds-sequence-parallel-size",
    "--async-save",  # Megatron-LM's background checkpoint writes (issue 23)
    "--universal-checkpoint",  # Megatron-DeepSpeed's, DeepSpeed's universal checkpoints (issue 30)
    # The rehearsal over a fake process group (issue 25).
    "--rehearse", "--rehearse-hidden-size", "--rehearse-seq-length", "--rehearse-ranks",
    "--rehearse-full-batch",
    # XLA devices through torch_xla (issue 26)
    "--device",
    "--xla-processes",
    "--mp-start-method",
    "--use-syncfree-optim",
    "--hang-timeout-minutes",  # stacks of a stalled rank (issue 24)
    "--xla-spmd", "--no-xla-spmd",  # SPMD over the XLA devices of a process (issue 26)
    # Issue 30: the peers' spellings of features we have, and their no-op flags.
    "--use-rotary-position-embeddings", "--rotary-position-embeddings-theta", "--rope-theta",
    "--norm-epsilon", "--encoder-num-layers", "--encoder-seq-length", "--use-dist-ckpt",
    "--dist-ckpt-format", "--no-mmap-bin-files", "--use-flash-attn-v1", "--use-flash-attn-triton",
    "--normalization", "--overlap-p2p-communication", "--no-overlap-p2p-communication",
    "--no-rope-fusion", "--auto-detect-ckpt-format", "--transformer-impl", "--DDP-impl",
    # Issue 32: the Llama family's options, in both peers' spellings.
    "--swiglu", "--group-query-attention", "--num-query-groups",
    "--num-key-value-heads", "--add-qkv-bias", "--rotary-interleaved", "--use-rope-scaling",
    "--rope-scaling-factor", "--no-position-embedding",
    # Issue 34: mixture-of-experts layers, Megatron-LM's spellings and Megatron-DeepSpeed's.
    "--moe-router-topk", "--topk", "--moe-router-score-function", "--moe-router-pre-softmax",
    "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
    "--moe-expert-capacity-factor", "--moe-token-drop-policy",
    "--moe-pad-expert-input-to-capacity", "--moe-layer-freq", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate", "--expert-interval",
    "--expert-model-parallel-size", "--moe-expert-parallel-size", "--moe-token-dispatcher-type",
    "--moe-grouped-gemm", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    # DeepSpeed-MoE under --deepspeed (Megatron-DeepSpeed's spellings).
    "--moe-loss-coeff", "--moe-train-capacity-factor", "--moe-eval-capacity-factor",
    "--moe-min-capacity", "--disable-moe-token-dropping", "--disable-moe-top2-2nd-expert-sampling",
    "--create-moe-param-group", "--mlp-type",
}


def test_flag_names_are_those_users_had_before_the_config_package():
    before = set(json.loads((Path(__file__).parent / "flags_before_config_package.json")
                            .read_text()))
    now = {s for a in build_parser()._actions for s in a.option_strings}
    assert before - now == set(), "flags users have in their scripts disappeared"
    assert now - before == NEW_FLAGS


def test_every_flag_has_a_description_and_a_default():
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        assert action.help and len(action.help) > 10, action.option_strings
        takes_value = action.nargs != 0
        if takes_value:
            assert re.search(r"\((default: .+|required)\)", action.help), action.option_strings
        # One default, said once, and never Python's None.
        assert action.help.count("(default:") <= 1, action.help
        assert "(default: None)" not in action.help, action.help


def test_each_field_declares_its_flags_once():
    seen: dict[str, str] = {}
    for name, cls in SLICE_CLASSES.items():
        for f in option_fields(cls):
            for spelling in flags_of(f):
                assert spelling not in seen, f"{spelling} in {seen.get(spelling)} and {name}"
                seen[spelling] = name
    # The same value is never a user-settable field of two slices.
    names = [f.name for cls in SLICE_CLASSES.values() for f in option_fields(cls)]
    assert len(names) == len(set(names))


# ----------------------------------------------------------------------------- accepted means used

_OUTSIDE = ("megatron", "tools", "pretrain_gpt.py")


def _consumer_sources() -> str:
    texts = []
    for entry in _OUTSIDE:
        path = REPO / entry
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        texts += [p.read_text() for p in files if "megatron/config" not in p.as_posix()]
    return "\n".join(texts)


def _read(name: str, sources: str) -> bool:
    return re.search(r"\.\b" + re.escape(name) + r"\b", sources) is not None


def unread_fields(slice_classes: dict, sources: str) -> list[str]:
    """Fields nothing outside the config package reads, following the values the package
    derives from them (``feeds``); refused flags are exempt (a test below shows they stop)."""
    unread = []
    for name, cls in slice_classes.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("refused") or f.metadata.get("settings_source"):
                continue
            targets = f.metadata.get("feeds") or (f.name,)
            if not all(_read(t, sources) for t in targets):
                unread.append(f"{name}.{f.name}")
    return unread


def test_every_config_field_is_read_outside_the_config_package():
    assert unread_fields(SLICE_CLASSES, _consumer_sources()) == []


@dataclasses.dataclass(frozen=True)
class _PlantedSlice(Slice):
    log_interval: int = option(default=1, help="A field the training loop reads.")
    planted_unread_flag: Optional[int] = option(default=None, help="Read by nobody.")


def test_only_settings_sources_are_read_inside_the_config_package():
    sources = [f.name for cls in SLICE_CLASSES.values() for f in dataclasses.fields(cls)
               if f.metadata.get("settings_source")]
    assert sources == ["use_checkpoint_args"]  # shown working in test_config_files.py


def test_a_planted_unread_field_is_found():
    assert unread_fields({"planted": _PlantedSlice}, _consumer_sources()) == [
        "planted.planted_unread_flag"]


@dataclasses.dataclass(frozen=True)
class _RefusingSlice(Slice):
    planned_capability: bool = option(default=False, help="Not built yet.",
                                      refused="that capability is not built yet")

    def __post_init__(self) -> None:
        check_refused(self)


def test_refused_flags_stop_the_run_naming_the_flag():
    with pytest.raises(ConfigError, match=re.escape("--planned-capability: that capability")):
        _RefusingSlice(planned_capability=True)
    assert not _RefusingSlice().planned_capability
    refused = [(f, cls) for cls in SLICE_CLASSES.values() for f in option_fields(cls)
               if f.metadata.get("refused")]
    for f, _ in refused:  # none today (--ckpt-format torch_dist was the last)
        default = field_default(f)
        value = [] if isinstance(default, bool) else [
            "1" if f.metadata.get("choices") else "x"]
        with pytest.raises(ConfigError, match=re.escape(flags_of(f)[0])):
            parse_args([*BASE, flags_of(f)[0], *value])


# ----------------------------------------------------------------------------- TOML

RUN_TOML = """
[model]
num_layers = 4
hidden_size = 64
num_attention_heads = 4
seq_length = 32
bf16 = true
activation = "gelu_tanh"

[parallel]
tensor_model_parallel_size = 2
sequence_parallel = true

[optimizer]
lr = 1e-3
adam_beta2 = 0.95
use_distributed_optimizer = true

[scheduler]
lr_decay_style = "cosine"
lr_warmup_iters = 2

[data]
data_path = [0.3, "corpus_a", 0.7, "corpus_b"]
vocab_file = "vocab.json"
merge_file = "merges.txt"

[training]
micro_batch_size = 2
global_batch_size = 8
train_iters = 10
rampup_batch_size = [4, 4, 16]

[logging]
log_interval = 5
"""
RUN_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--bf16", "--openai-gelu", "--tensor-model-parallel-size",
             "2", "--sequence-parallel", "--lr", "1e-3", "--adam-beta2", "0.95",
             "--use-distributed-optimizer", "--lr-decay-style", "cosine", "--lr-warmup-iters",
             "2", "--data-path", "0.3", "corpus_a", "0.7", "corpus_b", "--vocab-file",
             "vocab.json", "--merge-file", "merges.txt", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "10", "--rampup-batch-size", "4", "4",
             "16", "--log-interval", "5"]


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_toml_and_the_equivalent_flags_give_identical_configs(tmp_path):
    # rampup needs --train-samples: the file and the flags are both refused the same way.
    text = RUN_TOML.replace("train_iters = 10", "train_samples = 100").replace(
        "lr_warmup_iters", "lr_warmup_samples")
    renamed = {"--train-iters": "--train-samples", "--lr-warmup-iters": "--lr-warmup-samples"}
    flags = [renamed.get(a, a) for a in RUN_FLAGS]
    flags[flags.index("--train-samples") + 1] = "100"
    from_file = parse_args(["--config", _write(tmp_path, text)], world_size=4)
    from_flags = parse_args(flags, world_size=4)
    assert from_file == from_flags
    assert from_file.model.tensor_model_parallel_size == 2 and from_file.model.sequence_parallel
    assert from_file.data.data_path == ("0.3", "corpus_a", "0.7", "corpus_b")


def test_flags_override_the_file(tmp_path):
    text = RUN_TOML.replace("rampup_batch_size = [4, 4, 16]\n", "")
    c = parse_args(["--config", _write(tmp_path, text), "--hidden-size", "128", "--lr", "3e-4"],
                   world_size=4)
    assert (c.model.hidden_size, c.optimizer.lr, c.model.num_layers) == (128, 3e-4, 4)


def test_dump_config_then_config_reproduces_it(tmp_path):
    argv = [*BASE, "--tensor-model-parallel-size", "2", "--bf16", "--recompute-activations",
            "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size",
            "4", "--num-layers", "8", "--global-batch-size", "8", "--split", "90,5,5", "--seed", "7"]
    dumped = tmp_path / "effective.toml"
    first = parse_args([*argv, "--dump-config", str(dumped)], world_size=8)
    assert first.parallel.virtual_pipeline_model_parallel_size == 2
    again = parse_args(["--config", str(dumped)], world_size=8)
    assert again == first
    assert config_to_toml(again) == dumped.read_text()
    assert oct(dumped.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_dump_config_says_where_it_wrote(tmp_path, capsys):
    dumped = tmp_path / "effective.toml"
    parse_args([*BASE, "--dump-config", str(dumped)], world_size=1)
    assert capsys.readouterr().out.strip() == (
        f"wrote {dumped} (the whole configuration; --dry-run to stop here)")
    parse_args([*BASE, "--dump-config", str(dumped), "--dry-run"], world_size=1)
    assert capsys.readouterr().out.strip() == f"wrote {dumped} (the whole configuration)"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_dump_config_covers_every_settable_field(tmp_path):
    c = parse_args([*BASE, "--save", "ckpt", "--save-interval", "5", "--load", "ckpt",
                    "--tensorboard-dir", "tb", "--data-cache-path", "cache"])
    text = config_to_toml(c)
    for name, cls in SLICE_CLASSES.items():
        for f in option_fields(cls):
            value = getattr(getattr(c, name), f.name)
            if value is not None and not f.metadata.get("refused"):
                assert re.search(rf"^{f.name} = ", text, re.M), f.name


@pytest.mark.parametrize("text, expected", [
    ("[model]\nhiden_size = 64\n", ["run.toml", "'hiden_size'", "[model]", "hidden_size"]),
    ("[modle]\nhidden_size = 64\n", ["run.toml", "[modle]", "model"]),
    ("[model]\nhidden_size = \"big\"\n", ["run.toml", "[model] hidden_size", "an integer",
                                          "'big'"]),
    ("[model]\nfp16 = 1\n", ["run.toml", "[model] fp16", "true or false"]),
    ("[optimizer]\nlr = \"fast\"\n", ["run.toml", "[optimizer] lr", "a number"]),
    ("[optimizer]\noptimizer = \"lamb\"\n", ["run.toml", "[optimizer] optimizer", "adam"]),
    ("[training]\nrampup_batch_size = [1, 2]\n", ["run.toml", "rampup_batch_size",
                                                  "a list of 3"]),
    ("[data]\ndata_path = \"corpus\"\n", ["run.toml", "data_path", "a list"]),
    ("model = 3\n", ["run.toml", "model", "table"]),
    # A top-level key is a key, not a table: say so, with its line and where it belongs.
    ("log_dir = \"runs\"\n[model]\n", ["run.toml, line 1: key 'log_dir' is outside any table"]),
    ("# shape\nhidden_size = 64\n", ["run.toml, line 2: key 'hidden_size'", "belongs in [model]"]),
    ("[model\nhidden_size = 64\n", ["run.toml", "not valid TOML", "line 1"]),
    ("[model]\nhidden_size = 64\nhidden_size = 65\n", ["run.toml", "not valid TOML", "line 3"]),
    ("[model]\nnum_layers_per_virtual_pipeline_stage = 2\n",
     ["run.toml", "num_layers_per_virtual_pipeline_stage", "[parallel]"]),
])
def test_bad_toml_names_the_file_and_key(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", _write(tmp_path, text), *BASE])
    for part in expected:
        assert part in str(info.value), (part, str(info.value))


def test_missing_config_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="--config .*nope.toml: no such file"):
        parse_args(["--config", str(tmp_path / "nope.toml"), *BASE])


def test_extra_args_provider_values_come_from_an_extra_table(tmp_path):
    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    path = _write(tmp_path, "[extra]\nmy_flag = 5\n")
    c = parse_args(["--config", path, *BASE], extra_args_provider=provider)
    assert c.extra == {"my_flag": 5}
    with pytest.raises(ConfigError, match="unknown key 'my_flg' in \\[extra\\]"):
        parse_args(["--config", _write(tmp_path, "[extra]\nmy_flg = 5\n"), *BASE],
                   extra_args_provider=provider)


def test_the_gpt2_small_example_holds_nanogpts_hyperparameters():
    c = parse_args(["--config", str(REPO / "examples" / "configs" / "gpt2-small.toml")],
                   world_size=8)
    m, o, s, t = c.model, c.optimizer, c.scheduler, c.training
    assert (m.num_layers, m.num_attention_heads, m.hidden_size, m.seq_length) == (
        12, 12, 768, 1024)
    assert (m.hidden_dropout, m.attention_dropout, m.bf16, m.padded_vocab_size) == (
        0.0, 0.0, True, 50304)
    assert (o.lr, o.min_lr, o.weight_decay, o.adam_beta1, o.adam_beta2, o.clip_grad) == (
        6e-4, 6e-5, 0.1, 0.9, 0.95, 1.0)
    assert (s.lr_decay_style, s.lr_warmup_iters, s.lr_decay_iters) == ("cosine", 2000, 600000)
    # nanoGPT: 12 sequences x 5 accumulation steps x 8 GPUs per step.
    assert (t.micro_batch_size, t.global_batch_size, c.num_microbatches) == (12, 480, 5)
    assert isinstance(c, RunConfig)


def test_a_no_op_flag_says_so_once(capsys):
    parse_args([*BASE, "--log-throughput", "--no-bias-gelu-fusion"])
    out = capsys.readouterr().out
    assert out.count("--log-throughput is accepted for compatibility and has no effect") == 1
    assert out.count("--no-bias-gelu-fusion is accepted") == 1
    parse_args(BASE)
    assert "has no effect" not in capsys.readouterr().out
