#!/usr/bin/env bash
# The second environment's tests (issue 26): the XLA device tests and the core of the CPU
# suite on torch 2.9, the oldest torch the project supports. The main suite runs on the main
# environment's torch; this environment is .ci/xla_env.sh's (built once per machine, reused).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python_xla="$(bash .ci/xla_env.sh)"
echo "torch 2.9 environment ready in $((SECONDS - start)) s: $python_xla"
# The core selection: unit tests of the optimizer, data, tokenizer, model, config, device,
# parallel state, schedules and NaN guard (the 8-rank group test left to the main suite), one
# 2-rank training layout (tensor parallel, against one process) and one checkpoint resume.
core=(
    tests/unit/optimizer tests/unit/data tests/unit/tokenizer tests/unit/model
    tests/unit/test_config.py tests/unit/test_config_package.py tests/unit/test_device.py
    tests/unit/test_parallel_state.py tests/unit/test_pipeline_schedules.py
    tests/unit/test_nonfinite.py tests/unit/test_host_syncs.py tests/unit/test_ltor_masks.py
    "tests/distributed/test_training_layouts.py::test_layout_matches_single_process[tp2]"
    "tests/unit/test_checkpointing.py::test_resume_is_bit_identical[fp32-fp32]"
)
status=0
"$python_xla" -m pytest -q -p no:cacheprovider -m xla tests/xla || status=1
echo "XLA tests done at $((SECONDS - start)) s"
"$python_xla" -m pytest -q -p no:cacheprovider "${core[@]}" \
    --deselect tests/unit/test_parallel_state.py::test_initialize_on_8_gloo_ranks || status=1
echo "torch 2.9 environment: tests done in $((SECONDS - start)) s"
exit "$status"
