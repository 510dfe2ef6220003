"""A tiny random Hugging Face GPT-2 and its conversion to ours, for generation tests."""

from __future__ import annotations

import torch

from megatron.config import ParallelConfig, RunConfig
from megatron.model.hf_gpt2 import hf_to_megatron_state_dict, model_config_from_hf

VOCAB = 300


def tiny_hf_model(seed: int = 0, n_positions: int = 48):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=n_positions, n_embd=32,
                                  n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=VOCAB - 1,
                                  eos_token_id=VOCAB - 1)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def converted(hf, tp: int = 1, pp: int = 1) -> tuple[RunConfig, dict]:
    """Our run config at (tp, pp) and the full (unsharded) state dict of the HF model."""
    model = model_config_from_hf(hf.config, tensor_model_parallel_size=tp)
    config = RunConfig(model=model, parallel=ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp))
    return config, hf_to_megatron_state_dict(hf.state_dict(), config.model)


def prompts(lengths=(5, 9, 3, 7), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
