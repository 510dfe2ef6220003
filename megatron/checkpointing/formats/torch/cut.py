"""A whole checkpoint cut for one layout: the torch format's rank files (``model_optim_rng.pt``
and ``distrib_optim.pt`` dicts) of every (tensor, pipeline) rank, made in memory from a
``FullCheckpoint`` (``LayoutCut``). ``conversion.save_full_checkpoint`` writes them;
DeepSpeed's universal checkpoints load through them; ``rank_chunk_models`` gives generation
and evaluation one rank's model chunks at any launch layout."""

from __future__ import annotations

from typing import Optional

import torch

from megatron.checkpointing import optim_state
from megatron.checkpointing.contents import layout_dict, rank_file_state
from megatron.checkpointing.full_state import FullCheckpoint, model_config_from_dict, repad_vocab
from megatron.config import ModelConfig
from megatron.model.names import VOCAB_TENSORS, is_buffer, tp_parts
from megatron.model.placement import Chunk
from megatron.model.sharding import full_to_chunk_names, resize_vocab, split_tp, tp_piece


class LayoutCut:
    """``full`` prepared to be cut for the ranks of tensor-parallel size ``tp`` (vocabulary
    padded for it, optimizer state split): ``rank_files`` gives one (tensor, pipeline) rank's
    ``model_optim_rng.pt`` dict and, with the distributed optimizer, ``distrib_optim.pt``'s,
    as training at that layout saves them. ``config``: the run configuration they record;
    ``mixed``: the optimizer keeps fp32 main copies (``MixedPrecisionOptimizer``'s format).
    ``save_full_checkpoint`` writes every rank's; loading a format read whole (a universal
    checkpoint) builds this rank's only, from the parameters it holds."""

    def __init__(self, full: FullCheckpoint, tp: int, config: dict, *, distributed: bool,
                 mixed: bool, source: str) -> None:
        self.full, self.tp, self.config, self.source = full, tp, config, source
        self.distributed, self.mixed = distributed, mixed
        model_config = model_config_from_dict(config.get("model", {}), tp)
        self.model_config = model_config
        self.tied = not model_config.untie_embeddings_and_output_weights
        self.padded = repad_vocab(full.model, model_config.padded_vocab_size)
        self.opt_pieces = _optimizer_pieces(full, model_config, tp, distributed or mixed)

    def rank_files(self, chunks: list[Chunk], tp_rank: int,
                   pp: int) -> tuple[dict, Optional[dict]]:
        """The files of tensor rank ``tp_rank`` of the pipeline stage holding ``chunks``
        (one per virtual stage; ``pp``: the pipeline size)."""
        full = self.full
        chunk_models = rank_chunk_models(self.padded, self.model_config, self.tp, tp_rank,
                                         chunks)
        optimizer, distrib = None, None
        if self.opt_pieces is not None:
            rank_opt = {k: {key: v[tp_rank] for key, v in e.items()}
                        for k, e in self.opt_pieces.items()}
            chunk_opts = [full_to_chunk_names(rank_opt, c, self.tied) for c in chunks]
            if self.distributed:
                distrib = optim_state.gathered_from_named(chunk_opts, full.optimizer)
            else:
                optimizer = torch_optimizer(full.optimizer, chunk_models, chunk_opts,
                                             self.mixed)
        state = rank_file_state(
            iteration=full.iteration, config=self.config,
            parallel_layout=layout_dict(self.tp, pp, 1, len(chunk_models)),
            consumed=(full.consumed_train_samples, full.consumed_valid_samples),
            models=chunk_models, optimizer=optimizer, distributed_optimizer=distrib is not None,
            scheduler=full.scheduler, converted_from=self.source, extra=full.extra)
        return state, distrib


def rank_chunk_models(model: dict, config: ModelConfig, tp: int, tp_rank: int,
                      chunks: list[Chunk]) -> list[dict]:
    """The state dicts of tensor rank ``tp_rank``'s model ``chunks`` (one pipeline stage, one
    per virtual stage), from a full model of ``config`` whose vocabulary is padded for
    ``tp``: what ``GPTModel`` built for each chunk at that rank loads."""
    tied = not config.untie_embeddings_and_output_weights
    return [{k: tp_piece(k, v, tp, tp_rank, tp_parts(k, config))
             for k, v in full_to_chunk_names(model, chunk, tied).items()} for chunk in chunks]


def mixed_precision(config: dict) -> bool:
    """Whether a run with this configuration (plain dicts) keeps fp32 main copies in its
    optimizer (fp16/bf16, or a loss scale)."""
    opt = config.get("optimizer", {})
    model = config.get("model", {})
    return bool(model.get("fp16") or model.get("bf16") or opt.get("fp16") or opt.get("bf16")
                or opt.get("loss_scale") is not None)


def _optimizer_pieces(full: FullCheckpoint, config: ModelConfig, tp: int,
                      needs_mains: bool) -> Optional[dict]:
    if full.optimizer is None:
        return None
    rows = config.padded_vocab_size
    out = {}
    for name, entry in full.optimizer["param_state"].items():
        entry = dict(entry)
        if needs_mains and "param" not in entry:
            entry["param"] = full.model[name].float()
        if name in VOCAB_TENSORS:
            entry = {k: resize_vocab(v, rows) for k, v in entry.items()}
        out[name] = {k: split_tp(name, v, tp, tp_parts(name, config)) for k, v in entry.items()}
    return out


def torch_optimizer(full_opt: dict, chunk_models: list[dict], chunk_opts: list[dict],
                     mixed: bool) -> dict:
    names = [(f"{i}/{n}", v.shape) for i, c in enumerate(chunk_models) for n, v in c.items()
             if not is_buffer(n)]
    state = {f"{i}/{n}": e for i, c in enumerate(chunk_opts) for n, e in c.items()}
    torch_sd = optim_state.torch_from_named(state, full_opt["param_groups"], full_opt["step"],
                                            names)
    if not mixed:
        return torch_sd
    dtype = {f"{i}/{n}": v.dtype for i, c in enumerate(chunk_models) for n, v in c.items()}
    mains = [[state[k]["param"] for k in group if dtype[k] != torch.float32]
             for group in optim_state.group_param_names(names)]
    return {"optimizer": torch_sd, "grad_scaler": full_opt.get("grad_scaler"),
            "fp32_from_fp16_params": mains}
