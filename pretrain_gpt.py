"""Pretrain GPT: the model, batch and dataset callbacks handed to megatron.training.pretrain.

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron flags)
"""

from __future__ import annotations

import functools
import sys

import torch

from megatron.assembly.build import RunContext, gpt_model_provider
from megatron.core.pipeline_parallel.schedules import StageInfo
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.mock_dataset import MockGPTDataset
from megatron.model.gpt_batch import gpt_batch, masked_mean_loss
from megatron.model.gpt_model import GPTModel
from megatron.platform.output import print_rank_0
from megatron.training import pretrain


def model_provider(ctx: RunContext, pre_process: bool = True, post_process: bool = True,
                   first_layer: int = 0, num_layers=None) -> GPTModel:
    print_rank_0("building GPT model ...")
    return gpt_model_provider(ctx, pre_process, post_process, first_layer, num_layers)


def get_batch(ctx: RunContext, data_iterator):
    """tokens/labels ``[b, s]``, loss mask, attention mask (None = causal), position ids."""
    sample = ctx.batch_to_device(next(data_iterator)["text"])  # [b, s + 1]
    eod = ctx.tokenizer.eod if ctx.tokenizer is not None else None
    return gpt_batch(sample, eod, ctx.config.data,
                     context_attention=ctx.config.parallel.context_attention)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """The masked mean of the per-token losses ``output_tensor`` ``[b, s]``
    (``masked_mean_loss``, the DeepSpeed pipeline's reduction too). Mixture-of-experts
    layers' router losses are reported by the training engine (their gradients were attached
    in the forward pass)."""
    loss = masked_mean_loss(output_tensor, loss_mask)
    return loss, {"lm loss": loss.detach()}


def forward_step(ctx: RunContext, data_iterator, model, stage: StageInfo):
    """One micro-batch through this stage (``stage``, from the schedule, says which); stages
    that read no data get their input from the previous stage (set by the schedule)."""
    if stage.is_first or stage.is_last:
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(ctx, data_iterator)
    else:
        tokens = labels = loss_mask = attention_mask = position_ids = None
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, functools.partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(ctx: RunContext, num_samples: list[int]):
    """GPT datasets from --data-path (or per-split paths), or synthetic ones (--mock-data)."""
    cfg = ctx.config
    if cfg.data.mock_data:
        return tuple(MockGPTDataset(n, cfg.model.seq_length, cfg.model.vocab_size,
                                    cfg.training.seed + i) if n > 0 else None
                     for i, n in enumerate(num_samples))
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    d = cfg.data
    return build_train_valid_test_datasets(
        data_prefix=list(d.data_path) if d.data_path else None, data_impl=d.data_impl,
        splits_string=d.split, train_valid_test_num_samples=num_samples,
        seq_length=cfg.model.seq_length, seed=cfg.training.seed,
        skip_warmup=not d.mmap_warmup,
        train_data_prefix=list(d.train_data_path) if d.train_data_path else None,
        valid_data_prefix=list(d.valid_data_path) if d.valid_data_path else None,
        test_data_prefix=list(d.test_data_path) if d.test_data_path else None,
        data_cache_path=d.data_cache_path, in_memory=d.in_memory)


def main(argv=None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv)


if __name__ == "__main__":
    from megatron.checkpointing import CheckpointError
    from megatron.platform.output import global_rank

    try:
        main()
    except CheckpointError as error:  # a damaged or mismatched checkpoint: its message is all
        # Every rank raised it, rank 0 with the first failing rank's cause: one line.
        if global_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
