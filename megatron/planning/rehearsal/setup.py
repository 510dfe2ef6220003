"""The configuration each rehearsed rank runs: the user's, changed only where the rehearsal
must (see ``rehearsal_config``), and the checks made before any rank runs."""

from __future__ import annotations

import dataclasses

from megatron.config import ConfigError, RunConfig


def _shrunk_model(cfg: RunConfig) -> RunConfig:
    """--rehearse-hidden-size / --rehearse-seq-length: the same layers and heads, narrower
    or shorter. FFN, expert and attention widths shrink with the hidden size."""
    t, m = cfg.training, cfg.model
    changes = {}
    hidden = t.rehearse_hidden_size
    if hidden is not None and hidden != m.hidden_size:
        heads = m.num_attention_heads
        if hidden % heads:
            raise ConfigError(f"--rehearse-hidden-size ({hidden}) must be a multiple of "
                              f"--num-attention-heads ({heads}), so every head keeps a width")
        ffn = m.ffn_hidden_size * hidden // m.hidden_size
        tp = cfg.parallel.tensor_model_parallel_size
        if ffn * m.hidden_size != m.ffn_hidden_size * hidden or ffn % tp:
            raise ConfigError(
                f"--rehearse-hidden-size ({hidden}) does not shrink --ffn-hidden-size "
                f"({m.ffn_hidden_size}) to a whole width divisible by "
                f"--tensor-model-parallel-size ({tp}); try a multiple of "
                f"{m.hidden_size // _gcd(m.hidden_size, m.ffn_hidden_size)} x {heads}")
        kv = max(1, m.kv_channels * hidden // m.hidden_size)
        changes.update(hidden_size=hidden, ffn_hidden_size=ffn, kv_channels=kv)
        changes.update(_shrunk_experts(cfg, hidden))
    seq = t.rehearse_seq_length
    if seq is not None and seq != m.seq_length:
        changes.update(seq_length=seq, max_position_embeddings=max(
            seq, m.max_position_embeddings * seq // m.seq_length))
    if not changes:
        return cfg
    return cfg.replace(model=m.replace(**changes))


def _shrunk_experts(cfg: RunConfig, hidden: int) -> dict:
    """The experts' widths (resolved already: they do not follow --ffn-hidden-size again),
    shrunk as the FFN is, or a ConfigError naming the flag."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    changes = {}
    for name, flag in (("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
                       ("moe_shared_expert_intermediate_size",
                        "--moe-shared-expert-intermediate-size")):
        width = getattr(m, name)
        if width is None:
            continue
        shrunk = width * hidden // m.hidden_size
        if shrunk * m.hidden_size != width * hidden or shrunk % tp or not shrunk:
            raise ConfigError(
                f"--rehearse-hidden-size ({hidden}) does not shrink {flag} ({width}) to a "
                f"whole width divisible by --tensor-model-parallel-size ({tp}); try a "
                f"multiple of {m.hidden_size // _gcd(m.hidden_size, width)}")
        changes[name] = shrunk
    return changes


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def rehearsal_config(cfg: RunConfig) -> RunConfig:
    """What each rehearsed rank runs. Changed from the user's command line:

    - the model's width and sequence, where --rehearse-hidden-size/--rehearse-seq-length ask;
    - the data: synthetic tokens of the same shapes (--mock-data); the rehearsal proves
      communication and memory, not the data files (``tools/inspect_dataset.py`` does);
    - nothing is read or written: no --load, --save, TensorBoard or wandb;
    - one iteration (--exit-interval 1): the run's first, or with --rehearse-full-batch one
      at the full --global-batch-size (the ramp-up dropped);
    - fp16's dynamic loss scale starts at 1, so the step's update is taken: a real run's
      first steps may overflow and skip it, and a skipped step issues the first part of the
      same operations;
    - on the CPU, in this process: --use-cpu, no DataLoader workers, no --compile.
    """
    t = cfg.training
    cfg = _shrunk_model(cfg)
    training = dataclasses.replace(
        t, exit_interval=1, use_cpu=True, device="cpu", distributed_backend="gloo",
        xla_processes=None, compile=False,
        rampup_batch_size=None if t.rehearse_full_batch else t.rampup_batch_size,
        rehearse=False, dry_run=False)
    data = dataclasses.replace(cfg.data, mock_data=True, num_workers=0, data_path=None,
                               train_data_path=None, valid_data_path=None,
                               test_data_path=None)
    checkpoint = dataclasses.replace(cfg.checkpoint, load=None, save=None)
    logging = dataclasses.replace(cfg.logging, tensorboard_dir=None, wandb_project=None,
                                  wandb_exp_name=None, wandb_save_dir=None)
    optimizer = cfg.optimizer
    if optimizer.fp16 and optimizer.loss_scale is None:
        optimizer = dataclasses.replace(optimizer, initial_loss_scale=1.0,
                                        min_loss_scale=min(optimizer.min_loss_scale, 1.0))
    return cfg.replace(training=training, data=data, checkpoint=checkpoint, logging=logging,
                       optimizer=optimizer)


def check_rehearsable(cfg: RunConfig) -> None:
    """What the rehearsal cannot run, as a ConfigError naming the flag."""
    if cfg.deepspeed.deepspeed:
        raise ConfigError("--rehearse runs the built-in engine; DeepSpeed's engine (--deepspeed) "
                          "is not rehearsed: drop --deepspeed to rehearse the same layout")

