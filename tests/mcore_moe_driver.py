"""Real megatron-core's MoE routing maths on the logits in ``IN`` (``python -I
tests/mcore_moe_driver.py IN OUT``), for tests/unit/model/test_moe.py: writes to ``OUT`` what
its ``moe_utils`` functions give (routing, the load-balancing, sequence and z losses, token
dropping, the expert bias's routing). Run isolated, as tests/mcore_driver.py is: megatron-core's package is also named
``megatron``."""

import os
import sys

MCORE_DIR = os.environ.get("MEGATRON_CORE_DIR") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".test-deps", "megatron-core")
sys.path.insert(0, MCORE_DIR)

import torch  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402


def aux_loss(logits, topk, coeff, score_function):
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(
        logits, topk, score_function)
    return moe_utils.switch_load_balancing_loss_func(
        scores, routing_map.sum(0), logits.size(0), topk, logits.size(1), coeff)


def seq_aux_loss(logits, seq_length, topk, coeff, score_function):
    """The router's _apply_seq_aux_loss: experts of each sequence side by side."""
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(
        logits, topk, score_function)
    batch = logits.size(0) // seq_length
    scores, routing_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
    return moe_utils.switch_load_balancing_loss_func(
        scores, routing_map.sum(0), seq_length, topk, logits.size(1), coeff) / batch


def main(inp: str, out: str) -> None:
    case = torch.load(inp)
    logits, s, k = case["logits"], case["seq_length"], case["topk"]
    result = {}
    for fn in ("softmax", "sigmoid"):
        for pre in (False, True) if fn == "softmax" else (False,):
            for kk in (1, k):
                result[f"route/{fn}/{pre}/{kk}"] = moe_utils.topk_routing_with_score_function(
                    logits, kk, use_pre_softmax=pre, score_function=fn)
        result[f"aux/{fn}"] = aux_loss(logits, k, 0.01, fn)
        result[f"seq_aux/{fn}"] = seq_aux_loss(logits, s, k, 0.01, fn)
    for kk in (1, k):  # loss-free balancing: biased choice, unbiased weights
        result[f"route/sigmoid-bias/{kk}"] = moe_utils.topk_routing_with_score_function(
            logits, kk, score_function="sigmoid", expert_bias=case["bias"])
    result["z"] = moe_utils.z_loss_func(logits, 1e-3)
    probs, routing_map = moe_utils.topk_routing_with_score_function(logits, k)
    for policy in ("probs", "position"):
        for factor in (0.5, 1.0, 1.5):
            result[f"drop/{policy}/{factor}"] = moe_utils.apply_router_token_dropping(
                probs, routing_map, k, factor, drop_policy=policy)
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
