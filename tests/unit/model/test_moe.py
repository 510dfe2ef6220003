"""The mixture-of-experts layer's maths against hand computation: routing, the load-balancing
and z losses (megatron-core's definitions), capacity dropping under both policies, the
backward scale of the attached losses, and the layer's dispatch against a dense reference."""

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron.config import ConfigError, ModelConfig
from megatron.model import moe
from megatron.model.transformer import ParallelMLP, ParallelTransformerLayer
from tests.distributed.mcore_utils import NEEDS_MCORE

REPO = Path(__file__).resolve().parents[3]


def test_softmax_routing_is_softmax_over_the_chosen_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    probs, routing_map = moe.route(logits, topk=2)
    assert routing_map.tolist() == [[False, True, True, False], [False, False, True, True]]
    e = math.exp(1.0)
    assert torch.allclose(probs[0], torch.tensor([0.0, e / (e + 1), 1 / (e + 1), 0.0]))
    assert torch.allclose(probs.sum(1), torch.ones(2))
    # Pre-softmax: the probabilities of all four, top two kept as they are (sum below 1).
    pre, _ = moe.route(logits, topk=2, pre_softmax=True)
    assert torch.allclose(pre[0, 1:3], torch.softmax(logits[0], 0)[1:3])


def test_sigmoid_routing_renormalises_the_chosen_scores():
    logits = torch.tensor([[0.0, 2.0, -1.0]])
    probs, _ = moe.route(logits, topk=2, score_function="sigmoid")
    s = torch.sigmoid(torch.tensor([0.0, 2.0]))
    assert torch.allclose(probs[0], torch.tensor([s[0] / s.sum(), s[1] / s.sum(), 0.0]))
    single, _ = moe.route(logits, topk=1, score_function="sigmoid")  # k = 1: not renormalised
    assert torch.allclose(single[0, 1], torch.sigmoid(torch.tensor(2.0)))


def test_load_balancing_loss_by_hand():
    # 3 tokens, 2 experts, top-1. Softmax scores p_t, routing to each token's larger score.
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    p = torch.softmax(logits, 1)
    f = torch.tensor([2 / 3, 1 / 3])  # slots to expert 0: tokens 0 and 1
    big_p = p.mean(0)
    expected = 0.1 * 2 * (f * big_p).sum()
    assert torch.allclose(moe.load_balancing_loss(logits, topk=1, coeff=0.1), expected)
    # Top-2 of 2: every slot used, f_i = 1/2, so the loss is coeff * (P_0 + P_1) = coeff.
    assert torch.allclose(moe.load_balancing_loss(logits, topk=2, coeff=0.1),
                          torch.tensor(0.1))


def test_balanced_routing_gives_exactly_the_coefficient():
    a = 3.0
    logits = torch.tensor([[a, 0.0, 0.0, 0.0], [0.0, a, 0.0, 0.0], [0.0, 0.0, a, 0.0],
                           [0.0, 0.0, 0.0, a]])
    assert moe.load_balancing_loss(logits, topk=1, coeff=0.01).item() == pytest.approx(
        0.01, rel=1e-6)


def test_sequence_load_balancing_loss_is_the_mean_over_sequences():
    torch.manual_seed(0)
    s, b, e = 5, 3, 4
    logits = torch.randn(s, b, e)
    per_seq = [moe.load_balancing_loss(logits[:, i], 2, 0.1) for i in range(b)]
    got = moe.sequence_load_balancing_loss(logits.reshape(s * b, e), s, 2, 0.1)
    assert torch.allclose(got, torch.stack(per_seq).mean())


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: ln 2, ln 4
    expected = 1e-3 * (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert moe.z_loss(logits, 1e-3).item() == pytest.approx(expected, rel=1e-6)


# Four tokens, two experts, top-1: tokens 0, 1, 2 go to expert 0, token 3 to expert 1.
# Capacity ceil(4 x 1 / 2 x 1.0) = 2 tokens per expert.
PROBS = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.0, 0.8]])
MAP = PROBS > 0


def test_capacity_drops_the_lowest_probabilities():
    probs, routing_map = moe.drop_tokens(PROBS, MAP, topk=1, factor=1.0, policy="probs")
    assert routing_map.tolist() == [[False, False], [True, False], [True, False],
                                    [False, True]]  # token 0 (0.6) dropped
    assert torch.equal(probs, PROBS * routing_map)


def test_capacity_drops_the_latest_tokens_by_position():
    probs, routing_map = moe.drop_tokens(PROBS, MAP, topk=1, factor=1.0, policy="position")
    assert routing_map.tolist() == [[True, False], [True, False], [False, False],
                                    [False, True]]  # token 2 dropped
    assert torch.equal(probs, PROBS * routing_map)


def test_padding_to_capacity_fills_each_expert_with_zero_weight_tokens():
    probs, routing_map = moe.drop_tokens(PROBS, MAP, topk=1, factor=1.0, policy="position",
                                         pad_to_capacity=True)
    assert routing_map.sum(0).tolist() == [2, 2]
    assert routing_map[:, 1].tolist() == [True, False, False, True]  # token 0 pads expert 1
    assert probs[0, 1] == 0 and probs[3, 1] == PROBS[3, 1]


def test_capacity_above_the_token_count_drops_nothing():
    assert moe.expert_capacity(4, 2, 1, 2.5) == 5
    probs, routing_map = moe.drop_tokens(PROBS, MAP, topk=1, factor=2.5)
    assert torch.equal(routing_map, MAP) and torch.equal(probs, PROBS)


def test_attached_loss_adds_its_scaled_gradient_only():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    x = torch.tensor([3.0], requires_grad=True)
    y = moe.attach_loss(x * 2, (w ** 2).sum(), scale=0.25)
    assert torch.equal(y, x * 2)
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([2.0]))
    assert torch.equal(w.grad, 0.25 * 2 * w.detach())


def _config(**extra):
    return ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_experts=4,
                       moe_router_topk=2, hidden_dropout=0.0, attention_dropout=0.0,
                       ffn_hidden_size=32, **extra)


def test_layer_output_is_the_probability_weighted_sum_of_its_experts():
    cfg = _config(moe_shared_expert_intermediate_size=16)
    layer = moe.MoELayer(cfg, 1, ParallelMLP)
    x = torch.randn(6, 2, 16)
    tokens = x.reshape(12, 16)
    probs, _ = layer.router(tokens, 6)
    dense = sum(probs[:, j:j + 1] * expert(tokens.unsqueeze(1)).squeeze(1)
                for j, expert in enumerate(layer.local_experts))
    expected = dense.view(6, 2, 16) + layer.shared_experts(x)
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_gated_shared_expert_is_scaled_by_the_sigmoid_of_its_gate():
    """--moe-shared-expert-gate (Qwen2-MoE's shared_expert_gate, megatron-core's
    SharedExpertMLP): the shared expert's output times sigmoid(x . g), g of shape [1, h]."""
    cfg = _config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    layer = moe.MoELayer(cfg, 1, ParallelMLP)
    gate = layer.shared_experts.gate_weight
    assert gate.shape == (1, 16) and gate.abs().sum() > 0
    x = torch.randn(6, 2, 16)
    ungated = moe.MoELayer(cfg.replace(moe_shared_expert_gate=False), 1, ParallelMLP)
    ungated.load_state_dict({k: v for k, v in layer.state_dict().items()
                             if k != "shared_experts.gate_weight"})
    shared = layer.shared_experts(x)
    expected = ungated(x) - shared + torch.sigmoid(x @ gate.detach().t()) * shared
    assert torch.allclose(layer(x), expected, atol=1e-6)
    layer(x).sum().backward()
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="--moe-shared-expert-gate .* needs "
                       "--moe-shared-expert-intermediate-size"):
        _config(moe_shared_expert_gate=True)


def test_layer_reports_its_losses_in_training_only():
    cfg = _config(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    layer = ParallelTransformerLayer(cfg, 1)
    x = torch.randn(6, 2, 16)
    layer(x).sum().backward()
    reported = moe.reported_losses(layer)
    assert set(reported) == {"load_balancing_loss", "z_loss"}
    assert layer.mlp.router.weight.grad is not None
    logits = torch.nn.functional.linear(
        layer.post_attention_layernorm(x + layer.self_attention(layer.input_layernorm(x)))
        .reshape(12, 16), layer.mlp.router.weight)
    assert torch.allclose(reported["z_loss"], moe.z_loss(logits, 1.0), rtol=1e-5)
    layer.eval()
    layer(x)
    assert moe.reported_losses(layer) == {}


def test_router_losses_reach_the_router_through_the_backward_scale():
    cfg = _config(moe_aux_loss_coeff=0.5)
    layer = moe.MoELayer(cfg, 1, ParallelMLP)
    x = torch.randn(4, 1, 16)
    layer(x).sum().mul(0).backward()  # only the attached loss has a gradient
    once = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    moe.set_loss_scale([layer], 0.5)
    layer(x).sum().mul(0).backward()
    assert once.abs().sum() > 0 and torch.allclose(layer.router.weight.grad, 0.5 * once)


def test_flops_count_each_token_through_its_k_experts():
    """With top-k = E every token goes through every expert: the FLOPs are then 2 x every
    weight matrix (router included) per token, as for a dense model."""
    from megatron.core import parallel_state
    from megatron.model.gpt_model import GPTModel
    from megatron.planning.flops import flops_per_token

    m = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_experts=3,
                    moe_router_topk=3, moe_layer_freq="[1,0]", ffn_hidden_size=32,
                    moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=16, swiglu=True,
                    moe_shared_expert_gate=True, vocab_size=100, seq_length=8)
    parallel_state.destroy_model_parallel()
    built = GPTModel(m, device="meta")
    matrices = sum(p.numel() for name, p in built.named_parameters()
                   if p.dim() == 2 and "embeddings" not in name)
    forward = 2 * matrices + m.num_layers * 4 * m.seq_length * m.projection_size \
        + 2 * m.hidden_size * m.padded_vocab_size
    assert flops_per_token(m) == 3 * forward
    assert flops_per_token(m.replace(moe_router_topk=1)) < flops_per_token(m)


@NEEDS_MCORE
def test_routing_losses_and_dropping_equal_megatron_cores(tmp_path):
    """megatron-core 0.16.1's own moe_utils on the same logits (tests/mcore_moe_driver.py):
    routing (softmax, pre-softmax, sigmoid, sigmoid with an expert bias; k = 1, 2), the
    load-balancing loss per
    micro-batch and per sequence, the z-loss, and dropping by probability at three capacity
    factors. Its "position" dropping takes a top-k over the 0/1 map, whose ties CPU top-k
    breaks in no set order; ours keeps each expert's first tokens, its documented rule
    ("tokens at the end of each batch will be dropped"), checked above by hand."""
    torch.manual_seed(0)
    logits, s, k = torch.randn(24, 4), 6, 2
    bias = torch.tensor([0.3, -0.2, 0.0, 0.1])
    torch.save({"logits": logits, "seq_length": s, "topk": k, "bias": bias}, tmp_path / "in.pt")
    env = {key: v for key, v in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", str(REPO / "tests" / "mcore_moe_driver.py"),
                           str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    ours = {}
    for fn in ("softmax", "sigmoid"):
        for pre in (False, True) if fn == "softmax" else (False,):
            for kk in (1, k):
                ours[f"route/{fn}/{pre}/{kk}"] = moe.route(logits, kk, fn, pre)
        ours[f"aux/{fn}"] = moe.load_balancing_loss(logits, k, 0.01, fn)
        ours[f"seq_aux/{fn}"] = moe.sequence_load_balancing_loss(logits, s, k, 0.01, fn)
    for kk in (1, k):
        ours[f"route/sigmoid-bias/{kk}"] = moe.route(logits, kk, "sigmoid", expert_bias=bias)
    ours["z"] = moe.z_loss(logits, 1e-3)
    probs, routing_map = moe.route(logits, k)
    for factor in (0.5, 1.0, 1.5):
        ours[f"drop/probs/{factor}"] = moe.drop_tokens(probs, routing_map, k, factor)
    assert set(ours) <= set(theirs)
    for key, value in ours.items():
        pairs = zip(value, theirs[key]) if isinstance(value, tuple) else [(value, theirs[key])]
        for a, b in pairs:
            assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-7), key


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    """Data-parallel buckets wait for every parameter's gradient: an expert no token chose
    runs on no tokens and so reports zeros."""
    layer = moe.MoELayer(_config(), 1, ParallelMLP)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([3.0, 2.0, 1.0, -10.0]).unsqueeze(1)
                                  .expand(4, 16))
    x = torch.rand(5, 2, 16) + 0.1  # positive: expert 3's logit is always the lowest
    layer(x).sum().backward()
    unused = list(layer.local_experts[3].parameters())
    assert all(p.grad is not None and not p.grad.any() for p in unused)
    assert layer.local_experts[0].dense_h_to_4h.weight.grad.any()


def test_router_losses_keep_megatron_lms_names_in_the_log_and_tensorboard():
    from types import SimpleNamespace

    from megatron.training.log import format_log_line, parse_log_lines, training_series

    losses = {"lm loss": 4.5, "load_balancing_loss": 1.0025, "z_loss": 1.93}
    line = format_log_line(iteration=3, train_iters=9, consumed_samples=24, elapsed_ms=1.0,
                           lr=1e-3, global_batch_size=8, losses=losses, loss_scale=None,
                           grad_norm=1.0, skipped=0, nan=0, tgs=1.0, tflops=1.0)
    parsed = parse_log_lines(line)[0]
    assert {k: parsed[k] for k in losses} == losses
    switches = SimpleNamespace(log_batch_size_to_tensorboard=False,
                               log_loss_scale_to_tensorboard=False,
                               log_world_size_to_tensorboard=False,
                               log_timers_to_tensorboard=False)
    series = training_series(losses, learning_rate=1e-3, batch_size=8, loss_scale=None,
                             grad_norm=1.0, num_zeros=None, world_size=1,
                             iteration_seconds=1.0, logging=switches)
    assert series["lm-loss-training/lm loss"] == 4.5
    assert series["load_balancing_loss"] == 1.0025 and series["z_loss"] == 1.93


@pytest.mark.parametrize("extra", [{}, {"swiglu": True, "add_bias_linear": False}],
                         ids=["gelu-bias", "swiglu"])
def test_grouped_gemm_equals_the_loop(extra):
    """--moe-grouped-gemm: the same weights give the same output and gradients as one product
    per expert, with an expert that gets no token."""
    loop = moe.MoELayer(_config(**extra), 1, ParallelMLP)
    grouped = moe.MoELayer(_config(moe_grouped_gemm=True, **extra), 1, ParallelMLP)
    assert grouped.grouped and not loop.grouped
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(6, 2, 16)
    outs = []
    for layer in (loop, grouped):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        outs.append((out, xi.grad, [p.grad for p in layer.parameters()]))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-6)
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-6)
    for a, b in zip(outs[0][2], outs[1][2]):
        assert torch.allclose(a, b, atol=1e-6)
    # An expert without tokens: an empty group.
    inputs = [torch.randn(3, 16), torch.randn(0, 16), torch.randn(2, 16), torch.randn(1, 16)]
    for a, b in zip(loop._run_experts(inputs), grouped._run_experts(inputs)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6)
    # Widths grouped_mm cannot take are refused, naming them.
    with pytest.raises(ConfigError, match=r"--moe-ffn-hidden-size / tensor-parallel size \(30\)"):
        _config(moe_grouped_gemm=True, moe_ffn_hidden_size=30)


def test_the_layer_benchmark_compares_the_same_computation(capsys):
    """benchmarks/moe_layer.py: ours (loop and grouped) and HF Mixtral's block hold the same
    weights and give the same output (checked inside) before they are timed."""
    pytest.importorskip("transformers")
    from tests.distributed.training_utils import load_benchmark

    measured = dict(load_benchmark("moe_layer").main(
        ["--tokens", "64", "--hidden", "32", "--ffn", "64", "--iters", "1"]))
    assert {"ours (loop)", "ours (--moe-grouped-gemm)", "HF Mixtral (eager)"} <= set(measured)
    assert all(v > 0 for v in measured.values())
    assert "vs HF eager" in capsys.readouterr().out


def test_expert_bias_moves_choices_not_weights_and_follows_the_load():
    """--moe-router-enable-expert-bias: the bias picks the experts, the unbiased sigmoid
    scores weigh them; after a step each bias moves by the rate towards the under-loaded
    experts (sign(mean - count)), counted only where gradients flow."""
    logits = torch.tensor([[2.0, 1.5, -1.0, -2.0]])
    probs, chosen = moe.route(logits, 1, "sigmoid", expert_bias=torch.tensor([0.0, 0.5, 0, 0]))
    assert chosen.tolist() == [[False, True, False, False]]
    assert torch.allclose(probs[0, 1], torch.sigmoid(torch.tensor(1.5)))
    with pytest.raises(ConfigError, match="needs --moe-router-score-function sigmoid"):
        _config(moe_router_enable_expert_bias=True)
    cfg = _config(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                  moe_router_bias_update_rate=0.01)
    layer = moe.MoELayer(cfg, 1, ParallelMLP)
    assert "router.expert_bias" in layer.state_dict()
    assert "router.tokens_per_expert" not in layer.state_dict()
    with torch.no_grad():
        layer(torch.randn(6, 2, 16))  # no gradients: not counted
    assert layer.router.tokens_per_expert.sum() == 0
    x = torch.randn(6, 2, 16)
    layer(x).sum().backward()
    counts = layer.router.tokens_per_expert.clone()
    assert counts.sum() == 12 * 2
    moe.update_expert_biases([layer], 0.01, lambda t: None)
    want = torch.sign(counts.mean() - counts) * 0.01
    assert torch.equal(layer.router.expert_bias, want)
    assert layer.router.tokens_per_expert.sum() == 0


def test_routing_figures_and_where_they_are_shown():
    from megatron.training.log import format_log_line, training_series

    figures = moe.routing_figures(torch.tensor([6.0, 2.0, 0.0, 0.0]), 1.0, capacity=True)
    assert figures["expert load imbalance"] == 3.0  # 6/8 of the slots x 4 experts
    assert figures["dropped token fraction"] == 1 / 8
    assert [figures[f"expert {j} token share"] for j in range(4)] == [0.75, 0.25, 0.0, 0.0]
    assert "dropped token fraction" not in moe.routing_figures(torch.ones(4), 0.0, False)
    line = format_log_line(iteration=1, train_iters=1, consumed_samples=1, elapsed_ms=1.0,
                           lr=1.0, global_batch_size=1, losses={"lm loss": 1.0, **figures},
                           loss_scale=None, grad_norm=None, skipped=0, nan=0, tgs=1.0,
                           tflops=1.0)
    assert "expert load imbalance: 3.0" in line and "token share" not in line
    series = training_series(figures, learning_rate=1.0, batch_size=1, loss_scale=None,
                             grad_norm=None, num_zeros=None, world_size=1,
                             iteration_seconds=1.0, logging=types.SimpleNamespace(
                                 log_batch_size_to_tensorboard=False,
                                 log_loss_scale_to_tensorboard=False,
                                 log_world_size_to_tensorboard=False,
                                 log_timers_to_tensorboard=False))
    assert series["moe/expert 0 token share"] == 0.75 and "moe/expert load imbalance" in series
