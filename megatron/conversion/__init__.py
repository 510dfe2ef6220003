"""Checkpoint conversion and resharding: any saved layout -> one full state -> any layout.

Two functions for other tools (generation, evaluation, multi-level training) to call::

    from megatron.conversion import load_full_checkpoint, save_full_checkpoint

    full = load_full_checkpoint("ckpt/gpt2")           # the tracker's iteration, or iteration=N
    full.config          # the run configuration, plain dicts ({"model": {...}, ...}), tp 1/pp 1
    full.model           # GPTModel's state dict at tp 1, one stage (global layer numbers,
                         # vocabulary padded for tp 1): GPTModel(full.model_config()) loads it
    full.optimizer       # {"param_groups", "step", "param_state": {name: {"exp_avg", ...}},
                         #  "grad_scaler"} under the same names, or None
    full.iteration, full.consumed_train_samples, full.consumed_valid_samples
    full.scheduler, full.extra, full.release
    save_full_checkpoint(full, "ckpt/gpt2-tp4", tp=4, pp=1)    # -> the iteration folder

``load_full_checkpoint`` reads every ``mp_rank_*`` file of a folder saved at any tensor,
pipeline and virtual-pipeline (interleaved) size, with the distributed optimizer or without,
checks it against its manifest, and merges model and optimizer state (the last stage's copy of
tied word embeddings is dropped: it equals the first stage's). It also reads Megatron-DeepSpeed
and Megatron-LM checkpoints of the legacy ``language_model`` layout (model only).
``save_full_checkpoint`` splits a full state into ``iter_XXXXXXX/mp_rank_TT[_PPP]/`` files as
our training writes them, with ``manifest.json`` and the tracker, so ``pretrain_gpt.py --load``
resumes from it on the new layout with the optimizer state (and the LR schedule and consumed
samples) carried over. Converted files hold no random-generator state: a run resuming from one
starts its generators from ``--seed``.

``checkpointing.formats.torch.cut.rank_chunk_models`` cuts a full model for one rank of a
layout in memory (evaluation loads any checkpoint at any launch layout with it;
``save_full_checkpoint`` writes the cut's files).

Every format's whole read is its own (``Format.read_whole`` in ``checkpointing/formats/``):
``read_checkpoint`` reads the latest checkpoint of a folder of any kind
(``checkpointing.folder.find_checkpoint`` tells: torch, torch_dist, DeepSpeed's engines)
through it (``read_folder``). What stays here is format-free: the whole-checkpoint API above,
writing a full state at a new layout, and Hugging Face folders (``hf.load_hf_checkpoint`` /
``hf.save_hf_checkpoint``; ``hf.save_keeping_tokenizer`` saves a converted folder with its
tokenizer files). DeepSpeed's universal checkpoints: ``checkpointing.formats.deepspeed.universal``.
The command line is ``tools/checkpoint/convert.py`` (Megatron-LM's interface).
"""

from megatron.checkpointing.contents import CONVERTED_KEY
from megatron.checkpointing.full_state import FullCheckpoint, model_config_from_dict
from megatron.conversion.full import (
    load_full_checkpoint,
    read_checkpoint,
    read_folder,
    save_full_checkpoint,
)
from megatron.conversion.hf import ConversionError

__all__ = [
    "CONVERTED_KEY",
    "ConversionError",
    "FullCheckpoint",
    "load_full_checkpoint",
    "model_config_from_dict",
    "read_checkpoint",
    "read_folder",
    "save_full_checkpoint",
]
