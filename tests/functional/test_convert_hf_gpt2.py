"""tools/convert_hf_gpt2.py: a local HF GPT-2 becomes a Megatron checkpoint that trains."""

import pytest
import torch

import pretrain_gpt
from megatron.data.mock_dataset import MockGPTDataset
from megatron.model.gpt_model import GPTModel
from megatron.model.hf_gpt2 import model_config_from_hf
from tests.dist_utils import run_distributed
from tools import convert_hf_gpt2

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=32, n_embd=64, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return str(path), model.eval()


def test_converted_checkpoint_gives_hf_logits(hf_dir, tmp_path):
    path, hf = hf_dir
    flags = convert_hf_gpt2.convert(path, str(tmp_path / "ckpt"))
    assert "--openai-gelu" in flags and "--num-layers 2" in flags
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release"
    state = torch.load(tmp_path / "ckpt" / "release" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=True)
    ours = GPTModel(model_config_from_hf(hf.config)).eval()
    ours.load_state_dict(state["model"])
    ids = torch.randint(0, 1000, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[..., :1000], hf(ids).logits, atol=1e-4, rtol=1e-4)


def _finetune(rank, world_size, argv):
    return [h["losses"]["lm loss"] for h in pretrain_gpt.main(argv).history if h["losses"]]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_converted_checkpoint_loads_in_pretrain(hf_dir, tmp_path, tp, pp):
    """--load CONVERTED --finetune starts from GPT-2's weights, at tp 1 and at tp 2 x pp 2
    (converted straight to that layout). The vocabulary (1000) is padded to 1000 at both
    sizes: padding rows would enter the softmax (as in Megatron) and change the loss."""
    path, hf = hf_dir
    ckpt = str(tmp_path / "ckpt")
    flags = convert_hf_gpt2.convert(path, ckpt, make_vocab_size_divisible_by=4, tp=tp,
                                    pp=pp).split()
    argv = flags + ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-4",
                    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "999",
                    "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
                    "--num-workers", "0", "--load", ckpt, "--finetune", "--use-cpu",
                    "--tensor-model-parallel-size", str(tp),
                    "--pipeline-model-parallel-size", str(pp)]
    losses = [run for run in run_distributed(_finetune, tp * pp, argv) if run][-1]
    # The first step's loss is the converted model's loss on the first mock batch (samples 0
    # and 1 of the train split, seeded by --seed 1234): HF's own loss on those tokens.
    data = MockGPTDataset(4, 32, 1000, seed=1234)
    tokens = torch.stack([torch.from_numpy(data[i]["text"]) for i in range(2)])
    with torch.no_grad():
        shifted = torch.nn.functional.cross_entropy(
            hf(tokens[:, :-1]).logits.reshape(-1, 1000), tokens[:, 1:].reshape(-1)).item()
    assert len(losses) == 2
    assert losses[0] == pytest.approx(shifted, rel=1e-5)
