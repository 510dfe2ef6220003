"""DeepSpeed's configuration behind ``--deepspeed``: ``deepspeed_config_or_exit`` reads
``--deepspeed_config`` (or generates the JSON from our flags), checks it against the flags
(batch sizes, precision, ZeRO with the pipeline engine; gradient clipping and fp16 loss
scaling where the user gave those flags: left at their defaults, the file's values win) and
ends the run naming the file and flag, before any process group exists."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Optional

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.folder import DEEPSPEED, MEGATRON, namings_in
from megatron.checkpointing.formats.deepspeed.universal_folder import find_universal
from megatron.config import OptimizerConfig, RunConfig
from megatron.config.base import field_default, flag


class DeepSpeedSetupError(ValueError):
    """The DeepSpeed JSON file or its combination with the flags cannot run."""


# Config ----------------------------------------------------------------------------------


def read_config_file(path: str) -> dict:
    """The JSON object in ``path``; errors name the file (and the line of a syntax error)."""
    if not os.path.isfile(path):
        raise DeepSpeedSetupError(f"--deepspeed_config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as error:
        raise DeepSpeedSetupError(f"--deepspeed_config {path}: not valid JSON (line "
                                  f"{error.lineno}, column {error.colno}: {error.msg})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DeepSpeedSetupError(f"--deepspeed_config {path}: cannot be read ({error})") from None
    if not isinstance(value, dict):
        raise DeepSpeedSetupError(f"--deepspeed_config {path}: must hold a JSON object, "
                                  f"not {type(value).__name__}")
    return value


def _agree(ds: dict, key: str, ours: Any, flag_text: str, source: str) -> None:
    """``ds[key]`` must equal ``ours`` where the file sets it; set it from ``ours`` if not."""
    if key in ds and ds[key] != "auto" and ds[key] != ours:
        raise DeepSpeedSetupError(f"{source} has {key} = {ds[key]!r} but {flag_text} gives "
                                  f"{ours}: make them agree (or drop {key} from the file)")
    ds[key] = ours


def _given(opt: OptimizerConfig, name: str) -> bool:
    """Whether the user set ``name`` (on the command line or in --config): its value is not
    the default. A flag given at exactly its default value cannot be told from one left out."""
    field = next(f for f in dataclasses.fields(opt) if f.name == name)
    return getattr(opt, name) != field_default(field)


def _file_or_flag(section: dict, key: str, ours: Any, opt: OptimizerConfig, name: str,
                  where: str) -> None:
    """``section[key]`` from the flag ``name`` (value ``ours`` in DeepSpeed's units) where the
    file leaves it out; the file's value wins over a flag left at its default, but a flag the
    user gave that the file contradicts stops the run, naming both."""
    if key not in section or section[key] == "auto":
        section[key] = ours
    elif _given(opt, name) and section[key] != ours:
        given = getattr(opt, name)
        units = "" if given == ours else f" ({key} {ours!r})"
        raise DeepSpeedSetupError(
            f"{where}{key} = {section[key]!r} but {flag(name)} gives {given}{units}: make them "
            f"agree (or drop {key} from the file, or {flag(name)} from the command line)")


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _resolve_precision(ds: dict, cfg: RunConfig, source: str) -> None:
    opt = cfg.optimizer
    if "bfloat16" in ds and "bf16" not in ds:  # DeepSpeed's older spelling
        ds["bf16"] = ds.pop("bfloat16")
    for key, flag_text, on in (("fp16", "--fp16", opt.fp16), ("bf16", "--bf16", opt.bf16)):
        if key in ds and _enabled(ds[key]) != on:
            given = "given" if on else "not given"
            raise DeepSpeedSetupError(
                f"{source} has {key}.enabled = {str(_enabled(ds[key])).lower()} but {flag_text} "
                f"is {given}: make them agree")
    if opt.fp16:
        fp16 = dict(ds.get("fp16", {}))
        fp16.setdefault("enabled", True)
        where = f"{source} has fp16."
        for key, ours, name in (
                ("loss_scale", opt.loss_scale or 0, "loss_scale"),  # 0: dynamic
                ("initial_scale_power", int(round(math.log2(opt.initial_loss_scale))),
                 "initial_loss_scale"),
                ("loss_scale_window", opt.loss_scale_window, "loss_scale_window"),
                ("hysteresis", opt.hysteresis, "hysteresis"),
                ("min_loss_scale", opt.min_loss_scale, "min_loss_scale")):
            _file_or_flag(fp16, key, ours, opt, name, where)
        ds["fp16"] = fp16
    if opt.bf16:
        ds["bf16"] = {**ds.get("bf16", {}), "enabled": True}


def _resolve_zero(ds: dict, cfg: RunConfig, source: str) -> int:
    zero = dict(ds.get("zero_optimization", {}))
    if cfg.deepspeed.zero_stage is not None:
        zero["stage"] = cfg.deepspeed.zero_stage
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise DeepSpeedSetupError(f"{source} has zero_optimization.stage = {stage!r}: "
                                  "must be 0, 1, 2 or 3")
    ds["zero_optimization"] = zero
    pp = cfg.parallel.pipeline_model_parallel_size
    if stage >= 2 and not cfg.deepspeed.no_pipeline_parallel:
        where = (f"--pipeline-model-parallel-size {pp}: use --zero-stage 1 (or 0), which shards "
                 "the optimizer state and works with pipeline stages" if pp > 1 else
                 "add --no-pipeline-parallel to run the plain model in the engine, or use "
                 "--zero-stage 1")
        raise DeepSpeedSetupError(
            f"ZeRO stage {stage} partitions gradients (and, at 3, parameters), which "
            f"DeepSpeed's pipeline engine does not support; with {where}")
    cp = cfg.parallel.context_degree
    if stage == 3 and cp > 1:
        # Measured: DeepSpeed 0.19's ZeRO-3 with a sequence-parallel group gives gradient
        # norms and losses that part from the unsplit run's (ZeRO-1 and 2 match them).
        raise DeepSpeedSetupError(
            f"ZeRO stage 3 with {cfg.parallel.context_flag} {cp}: DeepSpeed's stage 3 does "
            "not reduce the sequence-split gradients to the unsplit run's; use --zero-stage "
            "1 or 2")
    experts = cfg.model.num_experts
    if experts is not None and stage == 3:
        raise DeepSpeedSetupError(f"ZeRO stage 3 (from {source}) with --num-experts "
                                  f"{experts}: DeepSpeed-MoE trains under ZeRO 0-2")
    if experts is not None and stage > 0 and not cfg.deepspeed.create_moe_param_group:
        raise DeepSpeedSetupError(
            f"ZeRO stage {stage} (from {source}) with --num-experts {experts}: add "
            "--create-moe-param-group (ZeRO needs DeepSpeed-MoE's experts in their own "
            "optimizer groups)")
    return stage


def _check_pipeline_engine(cfg: RunConfig) -> None:
    """What GPT's layers in DeepSpeed's PipelineModule cannot do (only the hidden state
    travels between its stages; it balances whole layers)."""
    if cfg.deepspeed.no_pipeline_parallel:
        return
    m, p, d = cfg.model, cfg.parallel, cfg.data
    pp = p.pipeline_model_parallel_size
    rules = (
        (d.reset_attention_mask, "--reset-attention-mask: only the hidden state travels "
         "between DeepSpeed's pipeline stages, so the mask must be the causal one"),
        (p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers,
         "--decoder-first/last-pipeline-num-layers: DeepSpeed balances the layers itself"),
        (m.num_layers % pp, f"--num-layers ({m.num_layers}) not divisible by "
         f"--pipeline-model-parallel-size ({pp}): DeepSpeed would split the layers unlike "
         "the built-in engine"),
    )
    for broken, why in rules:
        if broken:
            raise DeepSpeedSetupError(f"{why} (DeepSpeed's pipeline engine; "
                                      "--no-pipeline-parallel runs the plain model at "
                                      "--pipeline-model-parallel-size 1)")


def build_deepspeed_config(cfg: RunConfig) -> dict:
    """DeepSpeed's config dict for this run: the ``--deepspeed_config`` file completed from
    the flags (or generated from them), checked against them."""
    d, t, opt = cfg.deepspeed, cfg.training, cfg.optimizer
    path = d.deepspeed_config
    ds = read_config_file(path) if path else {}
    source = f"--deepspeed_config {path}" if path else "the generated DeepSpeed config"
    dp = cfg.data_parallel_size
    _agree(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size,
           f"--micro-batch-size {t.micro_batch_size}", source)
    _agree(ds, "train_batch_size", t.global_batch_size,
           f"--global-batch-size {t.global_batch_size}", source)
    _agree(ds, "gradient_accumulation_steps", cfg.num_microbatches,
           f"--global-batch-size / (--micro-batch-size x data-parallel size {dp})", source)
    _resolve_precision(ds, cfg, source)
    _file_or_flag(ds, "gradient_clipping", opt.clip_grad, opt, "clip_grad", f"{source} has ")
    ds.setdefault("steps_per_print", cfg.logging.log_interval)
    ds.setdefault("wall_clock_breakdown", False)
    _resolve_zero(ds, cfg, source)
    _check_pipeline_engine(cfg)
    if engine_reads_universal(ds, cfg):  # as Megatron-DeepSpeed's --universal-checkpoint
        ds["checkpoint"] = {**ds.get("checkpoint", {}), "load_universal": True}
    return ds


def engine_reads_universal(ds: dict, cfg: RunConfig) -> bool:
    """Whether --load names a universal checkpoint that DeepSpeed's engine reads itself
    (``checkpoint.load_universal``): its ZeRO-1/2 and bf16 optimizers restore their fp32 main
    copies and moments from it. At stage 0 without bf16 (our optimizer, bare), or loading the
    weights only (--no-load-optim, --finetune), ``formats.deepspeed.universal`` loads it. ZeRO-3 is
    refused: DeepSpeed's ZeRO-3 universal load does not resume the run it was saved from
    (measured on ours: the grad norm of the second step after it 4e-4 relative off)."""
    ck = cfg.checkpoint
    try:
        if not ck.load or find_universal(ck.load, ck.universal_checkpoint) is None:
            return False
    except CheckpointError:
        return False  # the start-up check of --load says what is wrong
    stage = ds["zero_optimization"]["stage"]
    if stage == 3:
        raise DeepSpeedSetupError(
            f"--load {ck.load} is a universal checkpoint, which DeepSpeed's ZeRO-3 engine does "
            "not resume exactly (its optimizer comes back off the saved run's): load it at "
            "--zero-stage 1 or 2, or without --deepspeed")
    optimizer_kept = stage >= 1 or _enabled(ds.get("bf16"))
    return optimizer_kept and not (ck.finetune or ck.no_load_optim)


def check_load_folder(cfg: RunConfig) -> None:
    """--deepspeed loads DeepSpeed's checkpoints only: a Megatron checkpoint says so."""
    load = cfg.checkpoint.load
    found = namings_in(load) if load else []
    if MEGATRON in found and DEEPSPEED not in found:
        raise DeepSpeedSetupError(
            f"--load {load} holds a Megatron checkpoint ({MEGATRON.tracker}), which DeepSpeed's "
            "engine does not read: drop --deepspeed to resume it with the built-in engine")


def _check_fp16_supported(ds: dict) -> None:
    """DeepSpeed refuses fp16 where its accelerator has none (a CPU) with a traceback on
    every rank after the model is built: say so first."""
    if not (ds.get("fp16") or {}).get("enabled"):
        return
    # optional: deepspeed, imported only under --deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        raise DeepSpeedSetupError(
            f"--fp16 with --deepspeed: DeepSpeed's {accelerator.device_name()} accelerator does "
            "not support fp16; use --bf16 or fp32 there, or drop --deepspeed (the built-in "
            "engine trains fp16 on any device)")


def deepspeed_config_or_exit(cfg: RunConfig) -> Optional[dict]:
    """None without --deepspeed; else the checked DeepSpeed config. Bad input ends the run
    with ``error: ...`` and status 2, before any process group exists."""
    if not cfg.deepspeed.deepspeed:
        return None
    try:
        ds = build_deepspeed_config(cfg)
        check_load_folder(cfg)
        _check_fp16_supported(ds)
    except DeepSpeedSetupError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return ds
