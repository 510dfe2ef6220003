"""README claims that code can check."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from megatron.config import ModelConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def _paragraph_with(text: str) -> str:
    for paragraph in README.read_text(encoding="utf-8").split("\n\n"):
        if text in " ".join(paragraph.split()):
            return " ".join(paragraph.split())
    raise AssertionError(f"README has no paragraph with {text!r}")


def test_layout_equivalence_claim_names_the_vocabulary_padding():
    claim = _paragraph_with("within 1e-5 (fp32)")
    assert "equal vocabulary padding" in claim
    assert "--make-vocab-size-divisible-by" in claim
    padded = {tp: ModelConfig(vocab_size=50257, tensor_model_parallel_size=tp).padded_vocab_size
              for tp in (1, 2)}
    assert padded == {1: 50304, 2: 50432}
    assert re.search(r"50304 at tensor parallel 1 but to 50432 at tensor parallel 2", claim)
    # The README's recipe for comparing tp 1 with tp 2 does pad both alike.
    assert "`--make-vocab-size-divisible-by 256` at tp 1 against the default at tp 2" in claim
    assert ModelConfig(vocab_size=50257, make_vocab_size_divisible_by=256).padded_vocab_size \
        == padded[2]


def _setup_extras() -> dict[str, list[str]]:
    """setup.py's extras_require, read from its syntax tree (running setup.py would build)."""
    tree = ast.parse((README.parent / "setup.py").read_text(encoding="utf-8"))
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    extras = next(k.value for k in call.keywords if k.arg == "extras_require")
    return ast.literal_eval(extras)


def test_every_extra_the_readme_installs_exists_and_none_names_the_index_apex():
    extras = _setup_extras()
    # PyPI's "apex" is an unrelated web toolkit; NVIDIA's apex is built from source.
    assert not any(re.fullmatch(r"apex\b.*", req) for reqs in extras.values() for req in reqs)
    named = set(re.findall(r"pip install -e '\.\[([\w-]+)\]'", README.read_text(encoding="utf-8")))
    assert named and named <= set(extras), named - set(extras)
    apex = _paragraph_with("What we use of each")
    for used in ("apex.normalization.FusedLayerNorm", "apex.optimizers.FusedAdam",
                 "flash_attn_func"):
        assert used in apex


def _command(line: str) -> str:
    """A test-setup command as written in README or .ci/run, without what only CI adds
    (``python -m``, ``-q``, ``-p no:cacheprovider``)."""
    line = re.sub(r"^((?:\w+=\S* )*)python -m ", r"\1", line.strip())
    return " ".join(w for w in line.replace("-p no:cacheprovider", "").split() if w != "-q")


def test_ci_runs_the_readme_test_command_line_for_line():
    text = README.read_text(encoding="utf-8")
    found = re.search(r"Run the tests \(the same lines `\.ci/run` runs\):\n\n    (.+)\n", text)
    assert found, "README lost its test command"
    readme = [_command(part) for part in found.group(1).split(" && ")]
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    ci = [_command(line) for line in ci
          if re.match(r"(\w+=\S* )*python -m (pip|ruff|pytest) ", line)]
    assert ci == readme
    # megatron-core stays out of the environment (its "megatron" would shadow ours).
    assert not any("megatron-core" in req for reqs in _setup_extras().values() for req in reqs)
    assert "--target .test-deps/megatron-core megatron-core==" in found.group(1)


def test_the_slurm_recipe_is_the_script_the_slurm_test_runs():
    """README's "Try SLURM on one machine" starts and stops the cluster with the script that
    tests/slurm_cluster.py runs, and submits the example as the SLURM test does."""
    from tests.functional import test_slurm_preemption
    from tests.slurm_cluster import SCRIPT

    text = README.read_text()
    recipe = text[text.index("**Try SLURM on one machine**"):]
    recipe = recipe[:recipe.index("\n\n**")]
    assert SCRIPT.relative_to(README.parent).as_posix() == "examples/slurm/local_cluster.sh"
    for line in ("bash examples/slurm/local_cluster.sh start /tmp/slurm",
                 "export SLURM_CONF=/tmp/slurm/slurm.conf",
                 "bash examples/slurm/local_cluster.sh stop /tmp/slurm"):
        assert line in recipe, line
    sbatch = " ".join(test_slurm_preemption.SBATCH[:3])
    assert sbatch in recipe and "examples/slurm/pretrain_gpt_slurm.sh CKPT VOCAB MERGES" in recipe
