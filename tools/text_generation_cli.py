"""A command-line client of the generation server (tools/run_text_generation_server.py).

    python tools/text_generation_cli.py 127.0.0.1:5000                # asks for prompts
    python tools/text_generation_cli.py 127.0.0.1:5000 --prompt "Hello" --tokens-to-generate 20

Interactive (as Megatron's): a prompt, then the number of tokens to generate; the server's
text is printed. End with Ctrl-D.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Optional


def api_url(address: str) -> str:
    """``host:port``, ``http://host:port`` or a full ``.../api`` URL -> the /api URL."""
    url = address if "://" in address else "http://" + address
    return url if url.rstrip("/").endswith("/api") else url.rstrip("/") + "/api"


def put(url: str, body: dict, timeout: float = 600.0) -> tuple[int, str]:
    """PUT ``body`` as JSON; the HTTP status and the reply's text."""
    data = json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return reply.status, reply.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def request_body(args: argparse.Namespace, prompt: str, tokens: int) -> dict:
    body = {"prompts": [prompt], "tokens_to_generate": tokens}
    for name in ("temperature", "top_k", "top_p", "random_seed"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    return body


def show(status: int, text: str) -> bool:
    if status != 200:
        print(f"Error {status}: {text}", file=sys.stderr)
        return False
    print("Megatron Response: ")
    print(json.loads(text)["text"][0])
    return True


def _ask() -> Optional[tuple[str, int]]:
    try:
        prompt = input("Enter prompt: ")
        while True:
            answer = input("Enter number of tokens to generate: ")
            if answer.strip().isdigit():
                return prompt, int(answer)
            print("a whole number, please")
    except EOFError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server: host:port (or its /api URL)")
    parser.add_argument("--prompt", help="one prompt, then exit (else: ask)")
    parser.add_argument("--tokens-to-generate", type=int, default=64)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", dest="top_k", type=int)
    parser.add_argument("--top-p", dest="top_p", type=float)
    parser.add_argument("--seed", dest="random_seed", type=int)
    args = parser.parse_args(argv)
    url = api_url(args.url)
    try:
        if args.prompt is not None:
            return 0 if show(*put(url, request_body(args, args.prompt,
                                                    args.tokens_to_generate))) else 1
        while (asked := _ask()) is not None:
            show(*put(url, request_body(args, *asked)))
    except urllib.error.URLError as e:
        print(f"error: cannot reach {url}: {e.reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
