#!/usr/bin/env bash
# Make (or reuse) the second environment: a virtual environment with torch 2.9.0 and
# torch_xla 2.9.0 (.ci/requirements-xla.txt) and this checkout installed in it, beside the
# main environment (torch 2.13), which it does not touch. Prints the environment's python.
#
# The environment lives outside the checkout, so that the next CI run on this machine reuses
# it: $MEGATRON_XLA_VENV, else ~/.cache/megatron-gpt/venv-torch2.9-xla. It is built under a
# ".partial" name and renamed once complete (every requirement installed, torch and
# torch_xla import at the pinned versions); a stamp holds the hash of the requirements, so a
# changed list builds it anew. Only PyPI has torch 2.9.0 for this machine: its Linux build
# brings the CUDA libraries (about 3.9 GB to download), which the CPU runs here never load.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=.ci/requirements-xla.txt
venv="${MEGATRON_XLA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-gpt/venv-torch2.9-xla}"
want="$(sha256sum "$requirements" | cut -d' ' -f1)"
mkdir -p "$(dirname "$venv")"

verify() {  # $1: environment folder; fails unless torch and torch_xla are the pinned ones
    "$1/bin/python" - "$requirements" <<'PY'
import re, sys
import torch
import torch_xla
pins = dict(re.findall(r"^(torch|torch_xla)==(\S+)", open(sys.argv[1]).read(), re.M))
found = {"torch": torch.__version__.split("+")[0], "torch_xla": torch_xla.__version__}
if found != pins:
    sys.exit(f"expected {pins}, found {found}")
PY
}

quietly() {  # pip's output only when it fails (the local indexes warn about every name)
    local log
    log="$(mktemp)"
    if ! "$@" > "$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

# One builder at a time on this machine; a second CI run waits and then reuses its work.
exec 9>"$venv.lock"
flock 9
if [ -f "$venv/complete.txt" ] && [ "$(cat "$venv/complete.txt")" = "$want" ] \
        && verify "$venv" >&2; then
    echo "reusing $venv" >&2
else
    rm -rf "$venv"
    partial="$venv.partial"  # an interrupted build resumes here: pip skips what is in
    [ -x "$partial/bin/python" ] || python -m venv "$partial"
    quietly "$partial/bin/python" -m pip install --no-cache-dir --progress-bar off \
        -r "$requirements"
    verify "$partial" >&2
    echo "$want" > "$partial/complete.txt"
    mv "$partial" "$venv"
    echo "built $venv" >&2
fi
# This checkout, without dependencies (pinned above); the C++ helpers build here too.
quietly "$venv/bin/python" -m pip install --no-deps --no-build-isolation -e .
echo "$venv/bin/python"
