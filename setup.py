"""Install the `megatron` package; builds the optional C++ dataset helpers with pybind11."""

import os

from setuptools import find_packages, setup

ext_modules = []
if os.path.exists(os.path.join("csrc", "helpers.cpp")):
    try:
        from pybind11.setup_helpers import Pybind11Extension

        ext_modules.append(
            Pybind11Extension(
                "megatron.data.helpers_cpp",
                ["csrc/helpers.cpp"],
                # fp-contract off: no fused multiply-add, so the blending arithmetic rounds
                # exactly like the numpy fallback (and Megatron's helpers) on every CPU.
                extra_compile_args=["-O3", "-ffp-contract=off"],
                cxx_std=17,
            )
        )
        # A failed compile must not fail the install: the numpy fallback gives the same results.
        ext_modules[-1].optional = True
    except ImportError:
        pass

setup(
    name="megatron-gpt",
    version="0.1.0",
    description="Megatron-DeepSpeed-compatible 3D-parallel GPT pre-training",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        # 2.9: the oldest torch CI runs (with torch_xla 2.9); newer APIs are probed.
        "torch>=2.9",
        "numpy",
        "regex",
        "tokenizers>=0.15",
        "tiktoken>=0.8",  # fast GPT-2 BPE for preprocessing; falls back to tokenizers
        "transformers>=4.40",
        "safetensors",  # HF GPT-2 weights in and out (tools/checkpoint/convert.py)
        "nltk",
        "tensorboard",
        "deepspeed",
        "tomli-w",  # --dump-config writes TOML (reading uses the standard library's tomllib)
        "tomli; python_version < '3.11'",
        "flask>=2.2",  # tools/run_text_generation_server.py (Megatron's REST API)
    ],
    extras_require={
        # psutil: megatron-core needs it. megatron-core itself (tests write real Megatron-LM
        # torch_dist checkpoints with it) is not an extra: its package is also named
        # "megatron" and, installed here, would shadow this one wherever the checkout is not
        # on the path. README's test command puts it in .test-deps/megatron-core, which only
        # tests/mcore_driver.py imports from.
        "test": ["pytest", "ruff", "datasets", "pyarrow", "wandb", "psutil", "sentencepiece"],
        # Llama2Tokenizer / GPTSentencePieceTokenizer read SentencePiece's tokenizer.model.
        "sentencepiece": ["sentencepiece"],
        "hf-data": ["datasets", "pyarrow"],  # preprocess_data.py --input of local HF datasets
        "wandb": ["wandb"],  # --wandb-project (offline runs)
        # No "cuda" extra: the index's "apex" is an unrelated package (NVIDIA's apex is built
        # from source) and flash-attn cannot build in pip's isolated build environment (it
        # imports torch). README "Optional CUDA packages" gives the commands for both.
    },
    ext_modules=ext_modules,
    zip_safe=False,
)
