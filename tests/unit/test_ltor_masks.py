"""get_ltor_masks_and_position_ids, vectorised, against a per-document loop written from
Megatron's description: after each EOD a new document starts, its positions restart at 0,
it attends to none of the earlier documents, and EOD tokens carry no loss with
--eod-mask-loss."""

import itertools

import pytest
import torch

from megatron.model.masks import get_ltor_masks_and_position_ids

EOD = 7


def _reference(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    b, s = tokens.shape
    loss_mask = torch.ones(b, s)
    position_ids = torch.arange(s).repeat(b, 1)
    visible = torch.tril(torch.ones(s, s, dtype=torch.bool)).repeat(b, 1, 1, 1)
    for row in range(b):
        start = 0
        for p in range(s):
            if eod is not None and eod_mask_loss and tokens[row, p] == eod:
                loss_mask[row, p] = 0.0
            if reset_position_ids:
                position_ids[row, p] = p - start
            if reset_attention_mask:
                visible[row, 0, p, :start] = False
            if eod is not None and tokens[row, p] == eod and (reset_position_ids
                                                               or reset_attention_mask):
                start = p + 1
    return (~visible if reset_attention_mask else None), loss_mask, position_ids


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("eod", [EOD, None])
def test_masks_and_positions_match_the_per_document_loop(flags, eod):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 12, (3, 20), generator=g)
    tokens[0, 0] = tokens[0, -1] = tokens[1, 4] = tokens[1, 5] = EOD  # edges, neighbours
    tokens[2][tokens[2] == EOD] = 1  # a row without any EOD
    got = get_ltor_masks_and_position_ids(tokens, eod, *flags)
    expected = _reference(tokens, eod, *flags)
    if expected[0] is None:
        assert got[0] is None
    else:
        assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
    if eod is not None and flags[0]:  # the reset does happen
        assert got[2][1, 6] == 0 and got[2][1, 5] == 0 and got[2][1, 4] == 4
