"""--deepspeed's configuration: the JSON file checked against the flags (or generated from
them), and the combinations refused before any process group exists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config import ConfigError, parse_args
from megatron.integrations.deepspeed import DeepSpeedSetupError, build_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 100 --deepspeed").split()


def config(*flags: str, world_size: int = 2, **json_file) -> dict:
    """DeepSpeed's dict for BASE + ``flags``; ``json_file`` (with a ``path``) is written
    first and passed as --deepspeed_config."""
    if json_file:
        path = json_file.pop("path")
        path.write_text(json.dumps(json_file))
        flags = (*flags, "--deepspeed_config", str(path))
    return build_deepspeed_config(parse_args([*BASE, *flags], world_size=world_size))


def error(*flags: str, world_size: int = 2, **json_file) -> str:
    with pytest.raises((DeepSpeedSetupError, ConfigError)) as info:
        config(*flags, world_size=world_size, **json_file)
    return str(info.value)


def test_generated_from_the_flags():
    ds = config("--no-pipeline-parallel", "--zero-stage", "2", "--fp16", "--loss-scale-window",
                "500", "--clip-grad", "0.5")
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["train_batch_size"] == 8
    assert ds["gradient_accumulation_steps"] == 2  # 8 / (2 x data-parallel 2)
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 32,
                          "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1.0}
    assert ds["gradient_clipping"] == 0.5 and "bf16" not in ds
    assert config("--bf16")["bf16"] == {"enabled": True}
    assert config()["zero_optimization"] == {"stage": 0}


def test_the_file_is_kept_and_zero_stage_overrides_it(tmp_path):
    ds = config("--zero-stage", "1", path=tmp_path / "ds.json", train_batch_size=8,
                zero_optimization={"stage": 0, "reduce_bucket_size": 1000},
                optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    assert ds["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert ds["optimizer"]["type"] == "Adam" and ds["gradient_accumulation_steps"] == 2


def test_missing_and_malformed_files_are_named(tmp_path):
    missing = tmp_path / "nope.json"
    message = error("--deepspeed_config", str(missing))
    assert str(missing) in message and "no such file" in message
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 1,}\n}\n')
    message = error("--deepspeed_config", str(bad))
    assert str(bad) in message and "line 3" in message
    bad.write_text("[1, 2]")
    assert "JSON object" in error("--deepspeed_config", str(bad))


def test_disagreements_name_the_file_and_the_flag(tmp_path):
    path = tmp_path / "ds.json"
    message = error(path=path, train_batch_size=16)
    assert "train_batch_size = 16" in message and "--global-batch-size 8" in message
    assert str(path) in message
    message = error(path=path, train_micro_batch_size_per_gpu=4)
    assert "train_micro_batch_size_per_gpu = 4" in message and "--micro-batch-size 2" in message
    message = error(path=path, gradient_accumulation_steps=4)
    assert "gradient_accumulation_steps = 4" in message
    message = error(path=path, fp16={"enabled": True})
    assert "fp16.enabled = true" in message and "--fp16 is not given" in message
    message = error("--bf16", path=path, bf16={"enabled": False})
    assert "bf16.enabled = false" in message and "--bf16 is given" in message


def test_zero_2_and_3_with_the_pipeline_engine_are_refused(tmp_path):
    message = error("--zero-stage", "3", "--pipeline-model-parallel-size", "2")
    assert "ZeRO stage 3" in message and "pipeline" in message and "--zero-stage 1" in message
    message = error(path=tmp_path / "ds.json", zero_optimization={"stage": 2})
    assert "ZeRO stage 2" in message and "--no-pipeline-parallel" in message
    message = error("--no-pipeline-parallel", "--pipeline-model-parallel-size", "2")
    assert "--no-pipeline-parallel" in message and "--pipeline-model-parallel-size 1" in message


def test_combinations_deepspeed_cannot_run():
    assert "--zero-stage 1" in error("--use-distributed-optimizer")
    assert "--recompute-granularity full" in error("--deepspeed-activation-checkpointing")
    assert "--partition-activations" in error("--checkpoint-in-cpu",
                                              "--deepspeed-activation-checkpointing",
                                              "--checkpoint-activations")
    assert "--reset-attention-mask" in error("--reset-attention-mask")
    assert "--log-bubble" in error("--log-bubble")


def _pretrain(*flags: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    environ.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, "--use-cpu", *flags],
                          cwd=REPO, env=environ, capture_output=True, text=True, timeout=120)


def test_cli_stops_before_any_process_group(tmp_path):
    proc = _pretrain("--deepspeed_config", str(tmp_path / "missing.json"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: --deepspeed_config {tmp_path / 'missing.json'}: no such file" in proc.stderr
    assert "compute device" not in proc.stdout  # no process group was made
    # ZeRO 3 with pp 2, as the first of 2 launched ranks would see it (no MASTER_PORT needed:
    # it stops first).
    proc = _pretrain("--zero-stage", "3", "--pipeline-model-parallel-size", "2",
                     RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: ZeRO stage 3" in proc.stderr and "compute device" not in proc.stdout


def test_only_the_adapter_package_and_the_deepspeed_format_import_deepspeed():
    importers = []
    for path in [*(REPO / "megatron").rglob("*.py"), *(REPO / "tools").rglob("*.py"),
                 REPO / "pretrain_gpt.py"]:
        if re.search(r"^\s*(import deepspeed|from deepspeed[\s.])", path.read_text(), re.M):
            importers.append(path.relative_to(REPO).as_posix())
    assert sorted(importers) == ["megatron/checkpointing/formats/deepspeed/files.py",
                                 "megatron/integrations/deepspeed/config.py",
                                 "megatron/integrations/deepspeed/engine.py",
                                 "megatron/integrations/deepspeed/moe.py"]


def test_deepspeed_moe_under_zero_needs_its_parameter_groups(tmp_path):
    """The stage may come from the JSON file: checked where the file is read."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1}}))
    flags = [*BASE, "--deepspeed", "--no-pipeline-parallel", "--num-experts", "4",
             "--deepspeed_config", str(path)]
    with pytest.raises(DeepSpeedSetupError, match="--create-moe-param-group"):
        build_deepspeed_config(parse_args(flags, world_size=1))
    assert build_deepspeed_config(parse_args([*flags, "--create-moe-param-group"],
                                             world_size=1))["zero_optimization"]["stage"] == 1


def test_a_megatron_checkpoint_under_deepspeed_says_what_to_do(tmp_path):
    from megatron.integrations.deepspeed import check_load_folder

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(DeepSpeedSetupError, match="Megatron checkpoint.*drop --deepspeed"):
        check_load_folder(parse_args([*BASE, "--load", str(tmp_path)], world_size=1))
    (tmp_path / "latest").write_text("global_step10")  # DeepSpeed's own tracker beside it
    check_load_folder(parse_args([*BASE, "--load", str(tmp_path)], world_size=1))


def test_logging_flags_deepspeed_does_not_measure_are_refused():
    # The engine's parameters and gradients are DeepSpeed's (ZeRO-sharded): no norm, no count.
    assert "--log-params-norm" in error("--log-params-norm")
    assert "--log-num-zeros-in-grad" in error("--log-num-zeros-in-grad")
    # What is measured the same way under DeepSpeed stays accepted.
    config("--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
           "--log-world-size-to-tensorboard", "--timing-log-level", "1")


FP16_FILE = dict(train_batch_size=8, gradient_clipping=0.3,
                 fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                       "loss_scale_window": 200, "hysteresis": 4, "min_loss_scale": 2})


def test_the_file_wins_over_clip_and_loss_scale_flags_left_at_their_defaults(tmp_path):
    ds = config("--fp16", path=tmp_path / "ds.json", **FP16_FILE)
    assert ds["gradient_clipping"] == 0.3
    assert ds["fp16"] == {**FP16_FILE["fp16"]}
    # Given flags that agree with the file are fine.
    ds = config("--fp16", "--clip-grad", "0.3", "--initial-loss-scale", "4096",
                "--hysteresis", "4", path=tmp_path / "ds.json", **FP16_FILE)
    assert ds["fp16"]["initial_scale_power"] == 12 and ds["gradient_clipping"] == 0.3


@pytest.mark.parametrize("flags, named", [
    (("--clip-grad", "0.5"), "has gradient_clipping = 0.3 but --clip-grad gives 0.5"),
    (("--loss-scale", "1024"), "has fp16.loss_scale = 0 but --loss-scale gives 1024"),
    (("--initial-loss-scale", "65536"),
     "fp16.initial_scale_power = 12 but --initial-loss-scale gives 65536.0 "
     "(initial_scale_power 16)"),
    (("--loss-scale-window", "500"), "fp16.loss_scale_window = 200 but --loss-scale-window"),
    (("--hysteresis", "3"), "fp16.hysteresis = 4 but --hysteresis gives 3"),
    (("--min-loss-scale", "4"), "fp16.min_loss_scale = 2 but --min-loss-scale gives 4.0"),
])
def test_given_clip_and_loss_scale_flags_the_file_contradicts_stop_the_run(tmp_path, flags,
                                                                           named):
    message = error("--fp16", *flags, path=tmp_path / "ds.json", **FP16_FILE)
    assert named in message and "ds.json" in message


def test_the_cpu_comm_op_build_is_announced_only_when_it_will_happen(tmp_path, monkeypatch):
    """DeepSpeed compiles its shared-memory CPU all-reduce at its first start on a machine:
    the folder it builds into is known beforehand, and nothing is announced once built."""
    from megatron.integrations.deepspeed import cpu_comm_op_to_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_comm_op_to_build()
    assert folder is not None and folder.startswith(str(tmp_path))
    assert os.path.basename(folder) == "deepspeed_shm_comm"
    with open(os.path.join(folder, "deepspeed_shm_comm.so"), "wb"):
        pass  # what torch's JIT loader leaves there once built
    assert cpu_comm_op_to_build() is None


def test_ulysses_batch_sizes_count_data_ranks_only_and_zero3_is_refused():
    """Megatron-DeepSpeed's --ds-sequence-parallel-size: the sequence ranks read the same
    samples, so DeepSpeed's batch arithmetic sees the data-parallel size alone."""
    ds = config("--no-pipeline-parallel", "--zero-stage", "2", "--ds-sequence-parallel-size",
                "2", world_size=4)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2  # 8/(2x2)
    assert "--zero-stage 1 or 2" in error("--no-pipeline-parallel", "--zero-stage", "3",
                                          "--ds-sequence-parallel-size", "2", world_size=4)
