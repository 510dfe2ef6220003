"""Text generation from a trained GPT: sampling, a KV-cached decoding loop that runs at any
tensor/pipeline layout, model loading for inference, and the REST server's request handling.

- ``sampling``: greedy, temperature, top-k, top-p (top-k then top-p, as Hugging Face).
- ``generation``: ``generate_tokens`` (ids in, ids out; batched prompts of any lengths);
  ``score_tokens`` (each id's log-probability given those before it, one forward).
- ``text``: ``generate_text`` (strings in, completions out; stop strings).
- ``forward``: one step across pipeline stages; the chosen tokens sent to every stage.
- (the model itself comes from ``megatron.inference.loading.build_inference_model``, which
  evaluation shares: any saved layout at any launch layout.)
- ``setup``: the tools' model/tokenizer flags and start-up.
- ``request_checks``, ``server``: Megatron's REST API (PUT /api), each request checked.
"""

from megatron.inference.text_generation.generation import (
    GREEDY,
    GenerationOutput,
    generate_tokens,
    score_tokens,
)
from megatron.inference.text_generation.sampling import SamplingParams, sample
from megatron.inference.text_generation.text import Completion, generate_text

__all__ = ["GREEDY", "Completion", "GenerationOutput", "SamplingParams", "generate_text",
           "generate_tokens", "sample", "score_tokens"]
