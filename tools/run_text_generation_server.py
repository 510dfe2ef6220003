"""Serve generation over HTTP with Megatron's REST API (PUT /api).

    python tools/run_text_generation_server.py --load CKPT --port 5000
    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --load CKPT_TP2
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["Once upon a time"], "tokens_to_generate": 32, "top_k": 1}'

Binds 127.0.0.1 unless --host says otherwise (0.0.0.0 serves every interface: anyone who can
reach the port can use the model). Global rank 0 serves; the other ranks of a tensor/pipeline
parallel model generate with it. SIGTERM or Ctrl-C (to every rank, as launchers send it, or to
rank 0) stops every rank quietly, after the request being generated.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.inference.text_generation.request_checks import MAX_PROMPTS  # noqa: E402
from megatron.inference.text_generation.server import (  # noqa: E402
    build_app,
    serve_other_ranks,
    stop_other_ranks,
)
from megatron.inference.text_generation.setup import (  # noqa: E402
    SetupError,
    add_model_args,
    is_rank_0,
    setup_generation,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: this "
                     "machine only)")
    srv.add_argument("--port", type=int, default=5000, help="port (0: any free one; the "
                     "address is printed)")
    srv.add_argument("--max-prompts", type=int, default=MAX_PROMPTS,
                     help="most prompts in one request")
    srv.add_argument("--max-tokens-to-generate", type=int, default=1024,
                     help="largest tokens_to_generate a request may ask for")
    return parser


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _ignore_stop_signals() -> None:
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _stop(signum, frame):
    _ignore_stop_signals()  # one stop: a second signal must not cut the shutdown short
    raise SystemExit(0)


def serve(gm, args: argparse.Namespace) -> None:
    """Rank 0: serve until SIGTERM or Ctrl-C, then release the other ranks."""
    from werkzeug.serving import make_server

    lock = threading.Lock()  # one request at a time, and the release between requests
    app = build_app(gm, max_prompts=args.max_prompts,
                    max_tokens_to_generate=args.max_tokens_to_generate, lock=lock)
    server = make_server(args.host, args.port, app, threaded=True)
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _stop)
    print(f"serving on http://{args.host}:{server.server_port}/api", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        stop_other_ranks(lock)


def serve_with_rank_0(gm) -> None:
    """The other ranks: generate with rank 0 until it releases them. A stop signal (the
    launcher signals every rank) is left to rank 0, which releases them between requests:
    a rank leaving on its own would cut a collective short and fail rank 0's next one."""
    _ignore_stop_signals()
    serve_other_ranks(gm)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_prompts < 1 or args.max_tokens_to_generate < 1:
        if is_rank_0():
            print("error: --max-prompts and --max-tokens-to-generate must be positive",
                  file=sys.stderr)
        return 2
    try:
        gm = setup_generation(args)
    except SetupError as e:
        if is_rank_0():  # every rank meets the same bad input; one says it
            print(f"error: {e}", file=sys.stderr)
        return 2
    if is_rank_0():
        serve(gm, args)
    else:
        serve_with_rank_0(gm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
