"""Tests on XLA devices (``pytest -m xla tests/xla``): they need torch_xla, which exists only
in CI's second environment (torch 2.9 + torch_xla 2.9, ``.ci/xla_env.sh``); elsewhere they
are skipped. Each run is a subprocess on ``PJRT_DEVICE=CPU`` (``CPU_NUM_DEVICES=N`` for N
devices), so the runtime starts fresh and no test's devices leak into another's."""

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(reason="needs torch_xla (CI's torch 2.9 environment)")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)
