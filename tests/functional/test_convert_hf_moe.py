"""Hugging Face's mixtures of experts through tools/checkpoint/convert.py: a tiny
MixtralForCausalLM (untied, renormalised top-2) and Qwen2MoeForCausalLM (QKV biases, a
gated shared expert, tied; top-2 probabilities not renormalised: --moe-router-pre-softmax;
and one with a dense layer and norm_topk_prob), hidden 32, 4 experts, 2 layers, vocabulary
128, built here with routers sharp enough that routing matters. They convert in with HF's
logits (fp32, within 1e-5) at tp 1 and, read at their saved layout by two gloo ranks, at
tp 2; greedy generation is HF's generate; training goes on from them at tp 2 (first loss
HF's); they convert back out to folders from_pretrained loads with the same logits, the same
stored tensor names and the MoE fields; the fields our GPT cannot compute are refused, in
both directions, with one line naming them."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from megatron.checkpointing.full_state import FullCheckpoint
from megatron.checkpointing.run_config import with_layout
from megatron.config import ModelConfig, to_dict
from megatron.conversion import ConversionError, load_full_checkpoint
from megatron.conversion.hf import save_hf_checkpoint
from megatron.model.gpt_model import GPTModel
from megatron.model.hf_llama import hf_llama_to_megatron_state_dict, model_config_from_hf_llama
from tests.dist_utils import run_distributed
from tests.functional.hf_models import build_hf_model, run_convert, save_hf_models
from tools.checkpoint import convert

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

VOCAB = 128  # a multiple of 64 x tp: the same padding (none) at tp 1 and tp 2
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
             num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, intermediate_size=48, tie_word_embeddings=False,
                     router_aux_loss_coef=0.02)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=24, intermediate_size=40,
                       shared_expert_intermediate_size=56, norm_topk_prob=False,
                       tie_word_embeddings=True)),
    # Layer 1 dense (mlp_only_layers: --moe-layer-freq [1,0]), top-k renormalised.
    "qwen2_moe_dense": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                        dict(num_experts=4, moe_intermediate_size=24, intermediate_size=40,
                             shared_expert_intermediate_size=56, norm_topk_prob=True,
                             mlp_only_layers=[1], tie_word_embeddings=False)),
}
IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _sharp_routers(name: str, param: torch.Tensor) -> None:
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        param.normal_(0, 1.0)  # decisive routing, gates away from 1/2


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return save_hf_models(tmp_path_factory, {
        family: build_hf_model(FAMILIES[family], SHAPE, _sharp_routers) for family in FAMILIES})


def _stored_names(folder) -> set[str]:
    with safetensors.safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return set(f.keys())


EXPECTED = {  # our fields of each family's config
    "mixtral": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                    moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
                    moe_shared_expert_gate=False, moe_layer_freq="1", moe_aux_loss_coeff=0.02,
                    add_qkv_bias=False),
    "qwen2_moe": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                      ffn_hidden_size=40, moe_router_pre_softmax=True,
                      moe_shared_expert_intermediate_size=56, moe_shared_expert_gate=True,
                      moe_layer_freq="1", moe_aux_loss_coeff=0.001, add_qkv_bias=True),
    "qwen2_moe_dense": dict(moe_router_pre_softmax=False, moe_layer_freq="[1,0]"),
}
HF_FIELDS = {  # what the saved config.json must say
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=48, router_aux_loss_coef=0.02,
                    output_router_logits=True, router_jitter_noise=0.0, sliding_window=None),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=40,
                      shared_expert_intermediate_size=56, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
                      router_aux_loss_coef=0.001, output_router_logits=True,
                      tie_word_embeddings=True),
    "qwen2_moe_dense": dict(architectures=["Qwen2MoeForCausalLM"], norm_topk_prob=True,
                            mlp_only_layers=[1], tie_word_embeddings=False),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_model_gives_hf_logits_and_converts_back(hf_dirs, tmp_path, family):
    path, hf = hf_dirs[family]
    ours_dir, back = tmp_path / "ours", tmp_path / "back"
    run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", path,
             "--save-dir", ours_dir, "--make-vocab-size-divisible-by", 64)
    full = load_full_checkpoint(str(ours_dir))
    config = full.model_config()
    assert {k: getattr(config, k) for k in EXPECTED[family]} == EXPECTED[family]
    # Expert tensors under their global index in the full model.
    assert "encoder.layers.0.mlp.local_experts.3.dense_4h_to_h.weight" in full.model
    model = GPTModel(config).eval()
    model.load_state_dict(full.model)
    with torch.no_grad():
        want = hf(IDS).logits
        torch.testing.assert_close(model(IDS)[..., :VOCAB], want, atol=1e-5, rtol=1e-5)
    run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", ours_dir,
             "--save-dir", back)
    saved = json.loads((back / "config.json").read_text())
    assert {k: saved.get(k) for k in HF_FIELDS[family]} == HF_FIELDS[family]
    assert _stored_names(back) == _stored_names(path)  # Mixtral's block_sparse_moe.*.w1 ...
    again = getattr(transformers, FAMILIES[family][1]).from_pretrained(back).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(IDS).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_hf_generate(hf_dirs, family):
    """Cached and uncached greedy decoding give HF's generate token for token."""
    from megatron.inference.text_generation.generation import generate_tokens

    _, hf = hf_dirs[family]
    config = model_config_from_hf_llama(hf.config.to_dict(), make_vocab_size_divisible_by=64)
    model = GPTModel(config).eval()
    model.load_state_dict(hf_llama_to_megatron_state_dict(hf.state_dict(), config))
    prompts = [[5, 17, 99, 3], [42, 7]]
    for use_cache in (True, False):
        out = generate_tokens(model, prompts, 12, use_cache=use_cache)
        for prompt, tokens in zip(prompts, out.tokens):
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0].tolist()
            assert tokens == want, (family, use_cache, tokens, want)


def _at_tp2(rank, world_size, load_dirs, prompts):
    """Each converted checkpoint at its saved layout (tp 2, each rank reading its own
    file): the whole logits of IDS and greedy tokens of ``prompts``."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.inference.loading import build_inference_model, config_from_checkpoint
    from megatron.inference.text_generation.generation import generate_tokens

    out = []
    for load_dir in load_dirs:
        parallel_state.initialize_model_parallel(2, 1)
        model = build_inference_model(config_from_checkpoint(load_dir, world_size),
                                      device=torch.device("cpu"))
        with torch.no_grad():
            part = model(IDS)  # [b, s, V/2]
        parts = [torch.empty_like(part) for _ in range(world_size)]
        dist.all_gather(parts, part.contiguous())
        tokens = generate_tokens(model, prompts, 8).tokens
        out.append((torch.cat(parts, dim=-1), tokens))
        parallel_state.destroy_model_parallel()
    return out


def test_converted_at_tp2_gives_hf_logits_on_two_ranks(hf_dirs, tmp_path):
    families = ["mixtral", "qwen2_moe"]
    load_dirs = []
    for family in families:
        load_dir = tmp_path / family
        run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", hf_dirs[family][0],
                 "--save-dir", load_dir, "--make-vocab-size-divisible-by", 64,
                 "--target-tensor-parallel-size", 2)
        assert (load_dir / "release" / "mp_rank_01").is_dir()
        load_dirs.append(str(load_dir))
    prompts = [[5, 17, 99, 3], [42, 7]]
    ranks = run_distributed(_at_tp2, 2, load_dirs, prompts)
    for family, *per_rank in zip(families, *ranks):
        hf = hf_dirs[family][1]
        with torch.no_grad():
            want = hf(IDS).logits
        greedy = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist() for p in prompts]
        for logits, tokens in per_rank:
            torch.testing.assert_close(logits[..., :VOCAB], want, atol=1e-5, rtol=1e-5)
            assert tokens == greedy, family


REFUSED_IN = [  # (family, config change, what the one-line error names)
    ("mixtral", dict(sliding_window=16), "sliding_window 16"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16,
                       layer_types=["sliding_attention", "full_attention"]),
     "sliding_window 16"),
    ("qwen2_moe", dict(mlp_only_layers=[0, 1]), "mlp_only_layers [0, 1] leave no layer"),
    ("qwen2_moe", dict(decoder_sparse_step=3), "decoder_sparse_step 3"),
    ("qwen2_moe", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
]


@pytest.mark.parametrize("family,change,named", REFUSED_IN,
                         ids=[f"{f}-{next(iter(c))}" for f, c, _ in REFUSED_IN])
def test_hf_fields_we_cannot_compute_are_refused(hf_dirs, tmp_path, capsys, family, change,
                                                 named):
    path, _ = hf_dirs[family]
    bad = tmp_path / "bad"
    bad.mkdir()
    os.symlink(os.path.join(path, "model.safetensors"), bad / "model.safetensors")
    config = json.loads(open(os.path.join(path, "config.json")).read())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                         "--load-dir", str(bad), "--save-dir", str(tmp_path / "out"),
                         "--make-vocab-size-divisible-by", "64"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert named in err and str(bad / "config.json") in err, err
    assert not (tmp_path / "out").exists()


MOE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
           vocab_size=VOCAB, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
           position_embedding_type="rope", ffn_hidden_size=40, num_experts=4,
           moe_ffn_hidden_size=24)
REFUSED_OUT = [  # (our fields, the flag the error names)
    (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
    (dict(add_bias_linear=True), "linear-layer biases"),
    (dict(moe_shared_expert_intermediate_size=56), "without --moe-shared-expert-gate"),
    (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
    (dict(add_qkv_bias=True), "--add-qkv-bias"),
    (dict(moe_layer_freq="[1,0]"), "--moe-layer-freq [1,0]"),
]


@pytest.mark.parametrize("fields,named", REFUSED_OUT, ids=[next(iter(f)) for f, _ in REFUSED_OUT])
def test_experts_neither_hf_model_computes_are_refused(tmp_path, fields, named):
    """Mixtral is the export of experts without a shared expert, Qwen2-MoE of those with a
    gated one; what neither holds is named, and nothing is written."""
    config = ModelConfig(**{**MOE, **fields})
    state = GPTModel(config, device="meta").state_dict()
    full = FullCheckpoint(config=with_layout({"model": to_dict(config), "data": {}}, 1, 1),
                          model=state, release=True)
    with pytest.raises(ConversionError, match=re.escape(named)) as error:
        save_hf_checkpoint(full, str(tmp_path / "out"))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def _finetune(rank, world_size, argv):
    import pretrain_gpt

    return [h["losses"]["lm loss"] for h in pretrain_gpt.main(argv).history if h["losses"]]


@pytest.mark.parametrize("layout", [
    ("--tensor-model-parallel-size", "2", "--micro-batch-size", "2"),
    # Two data-parallel ranks of one sample each, sharing the experts out: the file holds
    # all experts and each rank keeps its two.
    ("--tensor-model-parallel-size", "1", "--micro-batch-size", "1",
     "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"),
], ids=["tp2", "ep2"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_converted_checkpoint_trains_from_hf_weights(hf_dirs, tmp_path, family, layout):
    """--load CONVERTED --use-checkpoint-args --finetune at tp 2, and at expert parallel 2
    (the MoE flags, the shared expert's gate among them, come from the checkpoint): the first
    step's language-model loss is HF's own on the first mock batch, and training goes on."""
    from megatron.data.mock_dataset import MockGPTDataset

    path, hf = hf_dirs[family]
    ckpt = tmp_path / "ckpt"
    run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", path, "--save-dir", ckpt,
             "--make-vocab-size-divisible-by", 64, "--target-tensor-parallel-size", layout[1])
    argv = ["--load", str(ckpt), "--use-checkpoint-args", "--finetune", "--seq-length", "32",
            "--global-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--hidden-dropout", "0", "--attention-dropout",
            "0", "--eval-iters", "0", "--num-workers", "0", "--use-cpu", *layout]
    losses = [run for run in run_distributed(_finetune, 2, argv) if run][-1]
    data = MockGPTDataset(4, 32, VOCAB, seed=1234)
    tokens = torch.stack([torch.from_numpy(data[i]["text"]) for i in range(2)]).long()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(
            hf(tokens[:, :-1]).logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    assert len(losses) == 2 and losses[1] != losses[0]
    assert losses[0] == pytest.approx(want, rel=1e-5)
