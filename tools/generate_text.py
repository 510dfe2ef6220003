"""Sample text from a trained GPT: our checkpoint or a local Hugging Face GPT-2 folder.

    python tools/generate_text.py --load CKPT --prompt "Once upon a time" --max-new-tokens 40
    torchrun --nproc_per_node 2 tools/generate_text.py --load CKPT_TP2 --prompts-file p.txt
    python tools/generate_text.py --hf-model ./gpt2 --top-k 1          # interactive: >>
    python tools/generate_text.py --load CKPT_DS --temperature 0.75 --top-k 40 --top-p 0.95

``--load`` takes any checkpoint kind ``--load`` of training reads (ours, Megatron-DeepSpeed's,
DeepSpeed's engines). A checkpoint runs at the tensor x pipeline layout it was saved with
(one process each) unless the flags choose another; the tokenizer is the one it recorded
unless the tokenizer flags say otherwise. Each completion is printed as one block: a header
line naming the sample and its prompt, the prompt followed by the new text, and an end line
(interactively, at ``>>``, the text alone). ``--top-k 1`` is greedy (as in Megatron); ``--top-k`` and ``--top-p``
together keep the k likeliest, then the nucleus of those (as Hugging Face).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.text_generation import SamplingParams, generate_text  # noqa: E402
from megatron.inference.text_generation.setup import (  # noqa: E402
    SetupError,
    add_model_args,
    broadcast_object,
    is_rank_0,
    setup_generation,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    gen = parser.add_argument_group("generation")
    # The second spellings are Megatron-DeepSpeed's generate_samples_gpt.py flags.
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", "--sample-input-file", dest="prompts_file",
                     help="a text file with one prompt per line")
    gen.add_argument("--max-new-tokens", "--out-seq-length", dest="max_new_tokens", type=int,
                     default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0,
                     help="keep the k likeliest (1: greedy)")
    gen.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=0.0,
                     help="nucleus sampling (0: off); with --top-k, over the k kept (as "
                     "Hugging Face)")
    gen.add_argument("--greedy", action="store_const", const=1, dest="top_k",
                     help="the same as --top-k 1")
    gen.add_argument("--seed", type=int, default=1234, help="seed of the sampling")
    gen.add_argument("--stop", action="append", default=[],
                     help="end a completion at this string (repeatable; cut before it)")
    gen.add_argument("--ignore-eod", action="store_true",
                     help="go on past the end-of-document token")
    gen.add_argument("--no-kv-cache", action="store_true",
                     help="recompute every position at each step (slow; for comparison)")
    return parser


def check_args(args: argparse.Namespace) -> SamplingParams:
    """The sampling settings; bad values raise SetupError naming the flag."""
    if args.max_new_tokens < 1:
        raise SetupError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.prompts_file is not None and not os.path.isfile(args.prompts_file):
        raise SetupError(f"--prompts-file {args.prompts_file!r} does not exist")
    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise SetupError(f"--temperature/--top-k/--top-p: {e}") from None


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts


# sample_block's frame, read back: (index, count, prompt as printed, prompt + new text).
SAMPLE_BLOCK = re.compile(r"^===== sample (\d+) of (\d+) \| prompt: (.*) =====\n(.*?)\n"
                          r"===== end of sample \1 =====$", re.M | re.S)


def read_samples(output: str) -> list[str]:
    """The completed texts (prompt and new text) of the blocks in ``output``, in order."""
    return [text for *_, text in SAMPLE_BLOCK.findall(output)]


def sample_block(index: int, count: int, prompt: str, text: str) -> str:
    """One completion as printed: a header naming it and its prompt, the prompt and its new
    text, then an end line, so that samples with blank lines of their own stay apart."""
    return (f"===== sample {index} of {count} | prompt: {prompt!r} =====\n{prompt}{text}\n"
            f"===== end of sample {index} =====")


def complete(gm, args: argparse.Namespace, params: SamplingParams, prompts: list[str],
             framed: bool = True) -> bool:
    """Generate on every rank; rank 0 prints each prompt followed by its new text, as a
    ``sample_block`` when ``framed``. A prompt the model cannot take (too long, ids outside
    its vocabulary) is reported, on every rank alike before any step runs; returns whether
    the prompts were completed."""
    try:
        completions = generate_text(gm.model, gm.tokenizer, prompts, args.max_new_tokens,
                                    params=params, seed=args.seed, stop_strings=args.stop,
                                    stop_on_eod=not args.ignore_eod,
                                    use_cache=not args.no_kv_cache, device=gm.device)
    except ValueError as e:
        if is_rank_0():
            print(f"error: {e}", file=sys.stderr, flush=True)
        return False
    if is_rank_0():
        for i, c in enumerate(completions, 1):
            if framed:
                print(sample_block(i, len(completions), c.prompt, c.text), flush=True)
            else:
                print(c.prompt + c.text, flush=True)
                print(flush=True)
    return True


def interactive(gm, args: argparse.Namespace, params: SamplingParams) -> None:
    """Read prompts at ``>>`` on rank 0 until end of input; every rank generates each."""
    while True:
        prompt = None
        if is_rank_0():
            try:
                prompt = input(">> ")
            except EOFError:
                print()
        prompt = broadcast_object(prompt)
        if prompt is None:
            return
        complete(gm, args, params, [prompt], framed=False)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = check_args(args)
        prompts = read_prompts(args)
        gm = setup_generation(args)
    except SetupError as e:
        if is_rank_0():  # every rank meets the same bad input; one says it
            print(f"error: {e}", file=sys.stderr)
        return 2
    if prompts:
        return 0 if complete(gm, args, params, prompts) else 1
    interactive(gm, args, params)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
