"""The fast paths of the model give the numbers of the plain PyTorch reference paths."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.cross_entropy import linear_vocab_parallel_cross_entropy
from tests.dist_utils import run_distributed

S, B, H, V = 7, 3, 16, 50


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    target = torch.randint(0, V, (S, B), generator=g)
    # Uneven per-token loss weights: a uniform gradient could hide a wrong row scaling.
    grad_loss = torch.rand(S, B, generator=g)
    return hidden, weight, target, grad_loss


def _loss_and_grads(fn, hidden, weight, target, grad_loss):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = fn(hidden, weight, target)
    loss.backward(grad_loss)
    return loss.detach(), hidden.grad, weight.grad


def _unfused(hidden, weight, target):
    return vocab_parallel_cross_entropy(F.linear(hidden, weight), target)


def _torch_reference(hidden, weight, target):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.view(-1, V), target.view(-1), reduction="none").view(S, B)


def test_linear_cross_entropy_matches_unfused_and_torch():
    inputs = _inputs()
    got = _loss_and_grads(linear_vocab_parallel_cross_entropy, *inputs)
    for reference in (_unfused, _torch_reference):
        expected = _loss_and_grads(reference, *inputs)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_bf16_matches_unfused():
    inputs = _inputs(torch.bfloat16)
    got = _loss_and_grads(linear_vocab_parallel_cross_entropy, *inputs)
    expected = _loss_and_grads(_unfused, *inputs)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_linear_cross_entropy_leaves_frozen_weight_without_grad():
    hidden, weight, target, grad_loss = _inputs()
    weight = weight.detach()
    linear_vocab_parallel_cross_entropy(hidden, weight, target).backward(grad_loss)
    assert hidden.grad is not None and weight.grad is None


def _split_vocab(rank, world_size):
    """Each rank holds V/2 rows of the output weight; loss and gradients match one process."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        hidden, weight, target, grad_loss = _inputs()
        ref = _loss_and_grads(_torch_reference, hidden, weight, target, grad_loss)
        part = weight.detach().chunk(world_size)[rank].clone()
        loss, grad_hidden, grad_part = _loss_and_grads(linear_vocab_parallel_cross_entropy,
                                                       hidden, part, target, grad_loss)
        torch.distributed.all_reduce(grad_hidden)  # each rank's share of d loss / d hidden
        torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_hidden, ref[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_part, ref[2].chunk(world_size)[rank], rtol=1e-5,
                                   atol=1e-6)
        return True
    finally:
        parallel_state.destroy_model_parallel()


def test_linear_cross_entropy_split_over_two_ranks():
    assert all(run_distributed(_split_vocab, 2))


def _assert_close_to_scale(got, expected, name):
    """Equal up to fp32 rounding: the fused paths sum in another order, so elements near zero
    differ relative to themselves but not relative to the tensor's scale."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6 * scale,
                               msg=lambda m: f"{name}: {m}")


def _tiny_config(**overrides):
    from megatron.config import ModelConfig

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                  vocab_size=500, hidden_dropout=0.0, attention_dropout=0.0, seed=7)
    fields.update(overrides)
    return ModelConfig(**fields)


def _tokens(config, micro_batch=3):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (micro_batch, config.seq_length + 1), generator=g)


@pytest.mark.parametrize("untie", [False, True])
def test_model_loss_path_matches_cross_entropy_on_logits(untie):
    """The fused LM-head loss equals vocab_parallel_cross_entropy on the model's logits, in
    value and in every parameter's gradient."""
    from megatron.model.gpt_model import GPTModel

    config = _tiny_config(untie_embeddings_and_output_weights=untie)
    tokens = _tokens(config)
    results = []
    for fused in (True, False):
        model = GPTModel(config)
        if fused:
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        else:
            logits = model(tokens[:, :-1])  # [b, s, V]
            loss = vocab_parallel_cross_entropy(logits, tokens[:, 1:])
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, grad in ref_grads.items():
        _assert_close_to_scale(grads[name], grad, name)


@pytest.mark.parametrize("untie", [False, True])
def test_weight_grads_added_into_main_grad_match_plain_grads(untie):
    """Under the data-parallel wrapper the embedding and LM-head weight gradients go straight
    into main_grad; over two micro-batches they equal the plain model's summed .grad."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.model.gpt_model import GPTModel

    config = _tiny_config(untie_embeddings_and_output_weights=untie)
    plain, wrapped = GPTModel(config), DistributedDataParallel(GPTModel(config))
    wrapped.zero_grad_buffer()
    module = wrapped.module
    fused = [module.embedding.word_embeddings.weight]
    fused += [module.output_layer.weight] if untie else []
    made = []  # a gradient tensor made for one of these weights would show up here
    for weight in fused:
        weight.register_hook(lambda grad: made.append(grad) if grad is not None else None)
    for seed in (0, 1):
        tokens = _tokens(config, micro_batch=2 + seed)
        for model in (plain, wrapped):
            model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    assert made == []
    main_grads = {n: p.main_grad for n, p in module.named_parameters()}
    for name, p in plain.named_parameters():
        _assert_close_to_scale(main_grads[name], p.grad, name)
    assert all(p.grad is None for p in module.parameters())


def test_logits_workspace_reuses_buffers_only_when_free():
    """Two micro-batches in flight get separate buffers (as under a pipeline schedule), and
    later calls reuse given-back buffers with unchanged results."""
    from megatron.core.tensor_parallel.cross_entropy import LogitsWorkspace

    workspace = LogitsWorkspace()
    hidden, weight, target, grad_loss = _inputs()
    expected = _loss_and_grads(_torch_reference, hidden, weight, target, grad_loss)

    def fused(h, w, t):
        return linear_vocab_parallel_cross_entropy(h, w, t, workspace=workspace)

    h1, h2 = hidden.detach().clone().requires_grad_(), hidden.detach().clone().requires_grad_()
    loss1, loss2 = fused(h1, weight, target), fused(h2, weight, target)  # both in flight
    loss1.backward(grad_loss)
    loss2.backward(grad_loss)
    assert len(workspace._free) == 2
    buffers = {id(b) for b in workspace._free}
    for h in (h1, h2):
        torch.testing.assert_close(h.grad, expected[1], rtol=1e-5, atol=1e-6)
    again = _loss_and_grads(fused, hidden, weight, target, grad_loss)
    with torch.no_grad():
        no_grad_loss = fused(hidden, weight, target)
    assert {id(b) for b in workspace._free} == buffers
    for a, b in zip(again, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(no_grad_loss, expected[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(onednn, dtype, monkeypatch):
    """tensor_parallel's linear (oneDNN matmuls on CPU fp32) equals F.linear in value and
    in the gradients of input, weight and bias."""
    from megatron.core.tensor_parallel.layers import linear

    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 24, generator=g).to(dtype)
    w, b = torch.randn(40, 24, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    grad_y = torch.randn(5, 3, 40, generator=g).to(dtype)
    results = []
    for fn in (linear, F.linear):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = fn(*leaves)
        y.backward(grad_y)
        results.append([y.detach()] + [t.grad for t in leaves])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, expected in zip(*results):
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, **tol)


def test_fused_weight_grads_keep_overlap_hooks_running():
    """With --overlap-grad-reduce every linear weight still reports its gradient to the
    wrapper's hook (through a stand-in tensor), so its bucket can start reducing early."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.model.gpt_model import GPTModel

    config = _tiny_config()
    model = DistributedDataParallel(GPTModel(config), overlap_grad_reduce=True, bucket_size=1)
    model.zero_grad_buffer()
    tokens = _tokens(config)
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    ready = {id(p) for buffer in model.buffers for bucket in buffer.buckets for p in bucket.ready}
    linear_weights = [p for n, p in model.module.named_parameters()
                      if n.endswith(".weight") and p.ndim == 2 and "embeddings" not in n]
    assert linear_weights and all(id(p) in ready for p in linear_weights)
    assert all(getattr(p, "layer_adds_grad", False) for p in linear_weights)


def test_matmul_nt_reads_weight_views():
    """oneDNN's matmul gets a transposed weight as it is and other strided ones copied."""
    from megatron.core.tensor_parallel.layers import matmul_nt

    g = torch.Generator().manual_seed(0)
    x, w, w_t = (torch.randn(*shape, generator=g) for shape in ((6, 16), (24, 32), (16, 24)))
    for weight in (w_t.t(), w[:, :16], w[:, ::2]):  # [24, 16] each
        torch.testing.assert_close(matmul_nt(x, weight), F.linear(x, weight), rtol=1e-5,
                                   atol=1e-5)


def _bf16_main_grads(fusion: bool, watch: list):
    """Two bf16 micro-batches through a wrapped tiny model (fp32 gradient buffer); returns
    the main_grads and records in ``watch`` every weight gradient autograd saw."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.model.gpt_model import GPTModel

    config = _tiny_config(bf16=True)
    model = DistributedDataParallel(GPTModel(config), accumulate_allreduce_grads_in_fp32=True,
                                    gradient_accumulation_fusion=fusion)
    model.zero_grad_buffer()
    weights = [p for p in model.module.parameters() if p.ndim == 2]
    for weight in weights:
        weight.register_hook(lambda grad: watch.append(grad) if grad is not None else None)
    for seed in (0, 1):
        tokens = _tokens(config, micro_batch=2 + seed)
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    flags = {getattr(p, "fuse_grad_accumulation", None) for p in model.module.parameters()}
    return {n: p.main_grad.clone() for n, p in model.module.named_parameters()}, flags


def test_bf16_weight_grads_accumulate_into_fp32_main_grad():
    """--bf16: the backward adds weight gradients into the fp32 buffer itself (no gradient
    tensor reaches autograd for the embedding); --no-gradient-accumulation-fusion gives the
    same buffer through the hook. On the CPU the linear layers' half-precision products are
    added either way (equal bit for bit); the embedding sums repeated ids in fp32 instead of
    bf16, so it agrees to bf16 rounding."""
    fused_seen, plain_seen = [], []
    fused, fused_flags = _bf16_main_grads(True, fused_seen)
    plain, plain_flags = _bf16_main_grads(False, plain_seen)
    assert fused_flags == {True} and plain_flags == {False}
    assert all(g.dtype == torch.float32 for g in fused.values())
    # Fused: linear weights get an unfilled stand-in (so overlap hooks run), and nothing at
    # all for the word embeddings; unfused: a real gradient for every 2-D weight.
    assert len(plain_seen) > len(fused_seen)
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        if "word_embeddings" in name:
            torch.testing.assert_close(fused[name], grad, rtol=2e-2, atol=2e-2 * grad.abs().max())
        else:
            assert torch.equal(fused[name], grad), name


def test_mixed_accumulation_support_is_decided_per_device():
    from megatron.core.grad_accumulation import fusion_possible, mixed_accumulation_works

    assert mixed_accumulation_works(torch.device("cpu"))
    assert not mixed_accumulation_works(torch.device("meta"))
    assert fusion_possible(torch.float32, torch.float32, torch.device("meta"))
    assert fusion_possible(torch.bfloat16, torch.float32, torch.device("cpu"))
    assert not fusion_possible(torch.bfloat16, torch.float32, torch.device("meta"))
    assert not fusion_possible(torch.float32, torch.bfloat16, torch.device("cpu"))


def test_the_cuda_probe_runs_its_operands_and_reports_a_missing_kernel():
    """The probe behind mixed_accumulation_works on CUDA, run on the CPU: the fp32-output
    addmm has no CPU kernel, and that is reported as unsupported, not raised."""
    from megatron.core.grad_accumulation import _try_mixed_addmm

    assert _try_mixed_addmm(torch.device("cpu")) is False


def test_compiled_layers_keep_gradient_accumulation_fusion(monkeypatch):
    """Under --compile the linear layers still add their weight gradients into main_grad in
    the backward (a custom operator inside the compiled graph), to eager's values."""
    import megatron.core.grad_accumulation as ga
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.tensor_parallel.layers import compiled_fusion_works
    from megatron.model.gpt_model import GPTModel
    from megatron.model.transformer import compile_transformer_layers

    config = _tiny_config()
    tokens = _tokens(config)
    grads = []
    calls = []
    plain = ga.accumulate_matmul_
    monkeypatch.setattr(ga, "accumulate_matmul_", lambda *a: calls.append(1) or plain(*a))
    for compiled in (False, True):
        model = DistributedDataParallel(GPTModel(config))
        if compiled:
            assert compile_transformer_layers(model) == config.num_layers
        model.zero_grad_buffer()
        calls.clear()
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        # qkv, dense, h->4h, 4h->h per layer; none where this torch cannot keep the fusion
        # in compiled code (torch 2.9: compiled_fusion_works says so, the weights go unfused).
        fused = not compiled or compiled_fusion_works()
        assert len(calls) == (4 * config.num_layers if fused else 0)
        grads.append({n: p.main_grad.clone() for n, p in model.module.named_parameters()})
    for name, grad in grads[0].items():
        _assert_close_to_scale(grads[1][name], grad, name)
