"""Tiny Hugging Face models for the conversion tests: built from a family's config, their
norms and biases moved off their initial ones and zeros (so a converter that drops or swaps
them changes the logits), saved once per test module; and convert.py run as a user runs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from tools.checkpoint import convert

Family = tuple[str, str, dict]  # config class, model class, the family's own config fields


def build_hf_model(family: Family, shape: dict,
                   adjust: Optional[Callable[[str, torch.Tensor], None]] = None) -> Any:
    """An eval-mode model of ``family`` at ``shape`` (SDPA attention, seed 0); ``adjust(name,
    param)`` may change any parameter further, in place."""
    import transformers

    config_name, model_name, extra = family
    config = getattr(transformers, config_name)(**shape, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if adjust is not None:
                adjust(name, param)
    return model


def save_hf_models(tmp_path_factory, models: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """Each model saved to a folder of its own: name -> (folder, model)."""
    out = {}
    for name, model in models.items():
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (str(path), model)
    return out


def run_convert(*args) -> None:
    """tools/checkpoint/convert.py with these arguments (a GPT model); it must succeed."""
    assert convert.main(["--model-type", "GPT", *map(str, args)]) == 0
