"""The package's shape rules (issue 31) that code can check, read from the syntax tree:

- a project import made inside a function stays there only with a comment saying why: on its
  line or right above its group of imports, containing "cycle" (the imported module imports
  this one), "optional" (an optional dependency or a flag's path) or "lazy" (an entry point's
  --help or a launcher kept from importing torch, as measured);
- no module of ``megatron/`` is over 800 lines (STYLE.md: split it along a seam with a name).

Files: ``megatron/``, the entry scripts, ``tools/``, ``tasks/`` and ``benchmarks/``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The project's top-level names: what a project import starts with.
PROJECT = {"megatron", "pretrain_gpt", "run_pretrain_xla", "tools", "tasks", "benchmarks"}
REASONS = ("cycle", "optional", "lazy")
MAX_LINES = 800
# Paths left out of the checks (none now).
EXEMPT: tuple[str, ...] = ()


def _sources() -> list[Path]:
    files = [REPO / "pretrain_gpt.py", REPO / "run_pretrain_xla.py"]
    for folder in ("megatron", "tools", "tasks", "benchmarks"):
        files += sorted((REPO / folder).rglob("*.py"))
    return [f for f in files if not _rel(f).startswith(EXEMPT)]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _is_project_import(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in PROJECT for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PROJECT
    return False


def _local_imports(tree: ast.AST):
    """(import, the statements of the block it stands in) for each project import made
    inside a function, nested blocks included."""
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if not isinstance(block, list):
                    continue
                for statement in block:
                    if _is_project_import(statement):
                        yield statement, block


def _reason_given(statement: ast.stmt, block: list, lines: list[str]) -> bool:
    """A reason on the import's own lines, on another import of its run of consecutive
    imports, or on the line right above that run."""
    first = i = block.index(statement)
    while first > 0 and isinstance(block[first - 1], (ast.Import, ast.ImportFrom)) \
            and block[first - 1].end_lineno == block[first].lineno - 1:
        first -= 1
    last = i
    while last + 1 < len(block) and isinstance(block[last + 1], (ast.Import, ast.ImportFrom)) \
            and block[last + 1].lineno == block[last].end_lineno + 1:
        last += 1
    start, end = block[first].lineno - 1, block[last].end_lineno  # 1-based: the line above
    comments = [line.split("#", 1)[1] for line in lines[max(start - 1, 0):end] if "#" in line]
    return any(reason in comment for comment in comments for reason in REASONS)


def unexplained_local_imports(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: import`` for each function-local project import with no reason given
    (``file`` relative to ``root``)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for statement, block in _local_imports(ast.parse(text, filename=str(path))):
        # Seen once per enclosing function: nested functions repeat their imports.
        if not _reason_given(statement, block, lines):
            where = path.relative_to(root).as_posix()
            found.append(f"{where}:{statement.lineno}: {lines[statement.lineno - 1].strip()}")
    return sorted(set(found))


def test_function_local_project_imports_say_why():
    found = [entry for path in _sources() for entry in unexplained_local_imports(path)]
    assert not found, ("function-local project imports without a '# cycle: ...', "
                       "'# optional: ...' or '# lazy: ...' comment (move them to the top "
                       "otherwise):\n" + "\n".join(found))


def test_no_module_is_over_800_lines():
    long = [f"{_rel(p)}: {n} lines" for p in sorted((REPO / "megatron").rglob("*.py"))
            if not _rel(p).startswith(EXEMPT)
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split along a named seam):\n" \
        + "\n".join(long)


def test_the_check_finds_a_planted_import(tmp_path):
    """The rule fails where it should: unexplained imports (no comment, or one giving no
    reason), at their lines; explained ones (own line, line above, or above their run of
    imports) pass."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import os\n\n\n"
        "def bad():\n"
        "    from megatron.config import RunConfig\n"
        "    return RunConfig\n\n\n"
        "def good():\n"
        "    # cycle: megatron.config imports this module\n"
        "    from megatron.config import RunConfig\n"
        "    from megatron.core import parallel_state\n"
        "    import torch  # not the project's\n"
        "    from megatron.platform import xla  # optional: on XLA only\n"
        "    return RunConfig, parallel_state, torch, xla\n\n\n"
        "def vague():\n"
        "    # needed here\n"
        "    if True:\n"
        "        import pretrain_gpt\n"
        "    return pretrain_gpt\n", encoding="utf-8")
    assert unexplained_local_imports(planted, tmp_path) == [
        "planted.py:21: import pretrain_gpt",
        "planted.py:5: from megatron.config import RunConfig"]
