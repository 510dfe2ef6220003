"""megatron.platform.output' rank-aware output: print_rank_0 and the ``megatron`` loggers write once,
from global rank 0 (RANK before torch.distributed is up), or from every rank prefixed
``[rank N] `` after configure_output(log_all_ranks=True); errors from any rank."""

from __future__ import annotations

import logging

import pytest

from megatron.platform.output import RankOutput, configure_output, print_rank_0


@pytest.fixture
def output():
    """configure_output for one test; the ``megatron`` logger is put back afterwards."""
    logger = logging.getLogger("megatron")
    handlers, level = list(logger.handlers), logger.level
    yield configure_output
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.mark.parametrize("rank, all_ranks, printed", [
    ("0", False, "hello\ntwo lines\n"),
    ("1", False, ""),
    ("0", True, "[rank 0] hello\n[rank 0] two lines\n"),
    ("1", True, "[rank 1] hello\n[rank 1] two lines\n"),
])
def test_print_rank_0(output, monkeypatch, capsys, rank, all_ranks, printed):
    monkeypatch.setenv("RANK", rank)
    output(all_ranks)
    print_rank_0("hello\ntwo lines")
    assert capsys.readouterr().out == printed


def test_loggers_follow_the_same_rule(output, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    output(False)
    log = logging.getLogger("megatron.some.module")
    log.info("info")
    log.warning("warning")
    log.error("error")  # an error is shown by the rank that meets it
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "[rank 1] error\n")
    monkeypatch.setenv("RANK", "0")
    log.info("info")
    log.warning("warning")
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("info\n", "warning\n")


def test_configure_output_replaces_its_handler(output):
    output(True)
    output(False)
    handlers = [h for h in logging.getLogger("megatron").handlers if isinstance(h, RankOutput)]
    assert len(handlers) == 1 and not handlers[0].all_ranks


def test_before_configure_rank_0_prints(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    print_rank_0("not here")
    monkeypatch.delenv("RANK")
    print_rank_0("here")
    assert capsys.readouterr().out == "here\n"
