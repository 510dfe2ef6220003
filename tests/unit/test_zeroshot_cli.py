"""tasks/main.py refuses bad input before any process group or model exists: ``error: ...``
naming the flag, file or line, exit status 2."""

from __future__ import annotations

import pytest

from megatron.inference.evaluation.cli import main

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--use-cpu",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv + MODEL)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_bad_task_flags_are_named(capsys, tmp_path):
    data = tmp_path / "lambada.jsonl"
    data.write_text('{"text": "5 6 7"}\n{"text": oops}\n')
    assert "--valid-data takes exactly one file" in _error(capsys, ["--task", "LAMBADA",
                                                                   "--load", "x"])
    assert "--valid-data nowhere.txt: no such file" in _error(
        capsys, ["--task", "LAMBADA", "--valid-data", "nowhere.txt", "--load", "x"])
    assert "give --load CHECKPOINT_DIR or --hf-model HF_GPT2_DIR" in _error(
        capsys, ["--task", "LAMBADA", "--valid-data", str(data)])
    assert "argument --task: invalid choice: 'RACE'" in _error(
        capsys, ["--task", "RACE", "--valid-data", str(data), "--load", "x"])
    assert f"{data}, line 2: not JSON" in _error(
        capsys, ["--task", "LAMBADA", "--valid-data", str(data), "--load", "x"])
    data.write_text('{"text": "5 6 7"}\n{"text": "five six"}\n')  # not ids: NullTokenizer
    assert f"{data}, line 2: cannot tokenize it: NullTokenizer" in _error(
        capsys, ["--task", "LAMBADA", "--valid-data", str(data), "--load", "x"])


def test_hf_model_folder_without_config_is_named(capsys, tmp_path):
    err = _error(capsys, ["--task", "LAMBADA", "--valid-data", "x", "--hf-model",
                          str(tmp_path)])
    assert f"--hf-model {str(tmp_path)!r} has no config.json" in err


def test_tools_evaluate_picks_the_layout_of_a_tensor_parallel_checkpoint(tmp_path, monkeypatch,
                                                                        capsys):
    import torch

    from megatron.inference.evaluation.friendly import task_argv

    for rank in ("mp_rank_00", "mp_rank_01"):  # a release checkpoint saved at tp 2
        (tmp_path / "release" / rank).mkdir(parents=True)
        torch.save({"config": {"model": {"num_layers": 2}}},
                   tmp_path / "release" / rank / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: tp 1, merged in memory
    flags = task_argv(["lambada", "x.jsonl", "--load", str(tmp_path), "--vocab-file", "v"])
    assert "--tensor-model-parallel-size" not in flags
    assert "saved at tensor parallel 2 x pipeline parallel 1; evaluating it at tensor and " \
        "pipeline parallel 1 over 1 process(es), merged in memory" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")  # tp 2 x dp 2
    flags = task_argv(["lambada", "x.jsonl", "--load", str(tmp_path), "--vocab-file", "v"])
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "2"
    assert flags[:4] == ["--task", "LAMBADA", "--valid-data", "x.jsonl"]


def test_tools_evaluate_finds_the_tokenizer_copy_of_a_moved_checkpoint(tmp_path):
    from megatron.inference.evaluation.friendly import _tokenizer_flags

    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.json").write_text("{}")
    data = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/gone/tokenizer/vocab.json",
            "merge_file": "/gone/tokenizer/merges.txt"}  # no copy: the tokenizer names it
    assert _tokenizer_flags(data, str(tmp_path)) == [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(tmp_path / "tokenizer" / "vocab.json"),
        "--merge-file", "/gone/tokenizer/merges.txt"]
    null = {"tokenizer_type": "NullTokenizer", "vocab_size": 127, "vocab_file": None}
    assert _tokenizer_flags(null, str(tmp_path)) == [
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]


def test_tools_evaluate_help_lists_load_and_hf_model(capsys):
    """`tools/evaluate.py --help` names the model flags its README usage needs, and one of
    them is required."""
    from megatron.inference.evaluation.friendly import main as evaluate_main

    with pytest.raises(SystemExit) as exit_info:
        evaluate_main(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert "--load CKPT" in shown and "--hf-model DIR" in shown, shown
    with pytest.raises(SystemExit) as exit_info:
        evaluate_main(["wikitext", "wiki.txt"])
    assert exit_info.value.code == 2
    assert "one of the arguments --load --hf-model is required" in capsys.readouterr().err
