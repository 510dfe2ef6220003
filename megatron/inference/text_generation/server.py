"""Megatron's REST API for generation: ``PUT /api`` with a JSON body (see ``request_checks``),
answered with ``{"text": [...], "segments": [...], "logprobs": [...] or null}`` (see
``run_request``).

Global rank 0 serves HTTP. It checks each request, then hands it to every rank (the model is
spread over them) and all generate together; the other ranks wait in ``serve_other_ranks``.
A lock makes concurrent requests take turns, one batch at a time, so replies never mix (and
rank 0 releases the other ranks at shutdown only between requests). A
refused request gets HTTP 400 and its reason as the body (as Megatron), a body over 4 MiB
413; nothing a client sends stops the server.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Optional

import torch

from megatron.inference.text_generation.request_checks import (
    MAX_PROMPTS,
    GenerationRequest,
    RequestError,
    check_prompts_fit,
    decode_body,
    parse_request,
)
from megatron.inference.text_generation.setup import GenerationModel, broadcast_object
from megatron.inference.text_generation.text import generate_text

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


def run_request(gm: GenerationModel, request: GenerationRequest) -> dict:
    """Generate for one request on this rank; the JSON reply (the same on every rank), laid
    out as Megatron's: ``text`` is each prompt followed by its new text; ``segments`` every
    token of the sequence (the prompt's, a BOS added, then the new ones, the end-of-document
    one included) as text one by one; ``logprobs`` (when asked, else null) the
    log-probability of each of those tokens from the second on. ``tokens_to_generate`` 0
    scores the prompts: one forward, nothing generated."""
    completions = generate_text(gm.model, gm.tokenizer, request.prompts,
                                request.tokens_to_generate, params=request.params,
                                seed=request.seed, stop_strings=request.stop_strings,
                                add_bos=request.add_bos, prompt_logprobs=request.logprobs,
                                device=gm.device)
    logprobs = ([c.prompt_logprobs + c.logprobs for c in completions] if request.logprobs
                else None)
    return {"text": [c.prompt + c.text for c in completions],
            "segments": [[gm.tokenizer.detokenize([t]) for t in c.tokens] for c in completions],
            "logprobs": logprobs}


def serve_other_ranks(gm: GenerationModel) -> None:
    """Ranks other than 0: generate for each request rank 0 hands out, until it sends None."""
    while True:
        request = broadcast_object(None)
        if request is None:
            return
        try:
            run_request(gm, request)
        except Exception:  # noqa: BLE001 - rank 0 fails alike and answers 500; keep serving
            logger.exception("generation failed")


def stop_other_ranks(lock: Optional[threading.Lock] = None) -> None:
    """Rank 0: release the ranks waiting in ``serve_other_ranks``, once the request being
    generated (they take part in it) is done: ``lock`` is the app's. Ranks that are gone
    already (killed) get one line, not a traceback."""
    with lock or contextlib.nullcontext():
        try:
            broadcast_object(None)
        except RuntimeError as error:  # gloo/NCCL: the peer closed its connection
            logger.warning("the other ranks had stopped already (%s)",
                           str(error).splitlines()[0][:200])


def build_app(gm: GenerationModel, *, max_prompts: int = MAX_PROMPTS,
              max_tokens_to_generate: int = 1024, lock: Optional[threading.Lock] = None):
    """The Flask app of rank 0."""
    from flask import Flask, jsonify, request

    app = Flask("megatron_text_generation")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    lock = lock or threading.Lock()

    @app.route("/api", methods=["PUT"])
    def api():
        raw = request.get_data()  # a body over MAX_BODY_BYTES: 413, from too_large below
        try:
            req = parse_request(decode_body(raw), max_prompts=max_prompts,
                                max_tokens_to_generate=max_tokens_to_generate)
            check_prompts_fit(req, gm.tokenizer.tokenize, gm.context, gm.config.model.vocab_size)
        except RequestError as e:
            return str(e), 400
        except Exception as e:  # noqa: BLE001 - a bug in the checks; answered, not raised
            logger.exception("checking a request failed")
            return f"cannot check the request: {type(e).__name__}: {e}", 500
        with lock:
            try:
                if gm.device.type == "cuda":  # the current GPU is per thread
                    torch.cuda.set_device(gm.device)
                broadcast_object(req)
                return jsonify(run_request(gm, req))
            except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
                logger.exception("generation failed")
                return f"generation failed: {type(e).__name__}: {e}", 500

    @app.errorhandler(405)
    def wrong_method(_):
        return "use PUT /api with a JSON body", 405

    @app.errorhandler(413)
    def too_large(_):
        return f"the request body is larger than {MAX_BODY_BYTES} bytes", 413

    return app
