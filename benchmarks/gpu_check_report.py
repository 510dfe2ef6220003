"""The Markdown summary of a ``gpu_check.py`` run, from the record it writes as JSON: one
line on the machine, the steps with their wall time against plan and limit, every check,
the throughput table with the goal, and the generation table."""

from __future__ import annotations

from typing import Optional

CONTENDERS = ("ours", "ours-compile", "nanogpt", "nanogpt-compile", "hf")
THROUGHPUT_STEPS = {"throughput-124m": "gpt2-124m", "throughput-350m": "gpt2-350m",
                    "throughput-1.3b": "1.3b"}


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _steps(record: dict) -> dict[str, dict]:
    return {s["name"]: s for s in record["steps"]}


def machine_line(record: dict) -> str:
    env = _steps(record).get("env", {}).get("figures", {})
    if not env:
        return "machine: not recorded (the env step did not run)"
    commit = env.get("commit", {})
    dirty = " with uncommitted changes" if commit.get("dirty") else ""
    return (f"{env.get('device_name')} ({env.get('nvidia_smi') or 'no nvidia-smi'}); "
            f"torch {env.get('torch')}, CUDA {env.get('cuda')}, Python {env.get('python')}; "
            f"bf16 matmul peak {_fmt(env.get('peak_tflops'), '.1f')} TFLOP/s; commit "
            f"{commit.get('commit')}{dirty} ({commit.get('source')}); {record['date']}")


def steps_table(record: dict) -> list[str]:
    lines = ["| step | status | wall s | planned s | limit s | checks failed |",
             "|---|---|---:|---:|---:|---|"]
    for s in record["steps"]:
        failed = "; ".join(name for name, ok, _ in s["checks"] if not ok) or "-"
        lines.append(f"| {s['name']} | {s['status']}{' (' + s['note'] + ')' if s['note'] else ''}"
                     f" | {_fmt(s['wall_s'], '.1f')} | {_fmt(s['planned_s'], '.0f')} "
                     f"| {_fmt(s['limit_s'], '.0f')} | {failed} |")
    lines.append(f"\ntotal {record['total_s']:.1f} s")
    return lines


def checks_list(record: dict) -> list[str]:
    return [f"- [{'x' if ok else ' '}] {s['name']}: {name}{f' ({detail})' if detail else ''}"
            for s in record["steps"] for name, ok, detail in s["checks"]]


def throughput_table(record: dict) -> list[str]:
    found = {shape: _steps(record)[step]["figures"] for step, shape in THROUGHPUT_STEPS.items()
             if _steps(record).get(step, {}).get("figures", {}).get("shapes")}
    if not found:
        return ["no throughput figures"]
    lines = ["tokens/s (median of rounds); MFU of our faster variant against the peak; "
             "peak memory (MB) of ours",
             "", "| shape | " + " | ".join(CONTENDERS)
             + " | best ours / nanoGPT+compile | MFU | memory ours |",
             "|---|" + "---:|" * (len(CONTENDERS) + 3)]
    for shape, figures in found.items():
        contenders = figures["shapes"][shape]["contenders"]
        goal = figures["goal"]
        best = goal["used"].get(shape)
        mfu = contenders[best]["mfu"] if best else None
        cells = [_fmt(contenders.get(c, {}).get("tokens_per_s"), ",.0f") for c in CONTENDERS]
        lines.append(f"| {shape} | " + " | ".join(cells)
                     + f" | {_fmt(goal['ratios'].get(shape), '.3f')} by {best} "
                     f"| {_fmt(None if mfu is None else 100 * mfu, '.1f', '%')} "
                     f"| {_fmt(contenders.get('ours', {}).get('memory_mb'), '.0f')} |")
    if any(f.get("dry_run") for f in found.values()):
        lines.append("(dry run: tiny shapes on the CPU, torch.compile off; not a measurement)")
    return lines


def generation_table(record: dict) -> list[str]:
    rows = _steps(record).get("generate", {}).get("figures", {}).get("rows")
    if not rows:
        return ["no generation figures"]
    lines = ["| batch | generator | tokens/s | vs HF | same tokens as HF |",
             "|---:|---|---:|---:|---|"]
    lines += [f"| {r['batch']} | {r['generator']} | {r['tokens_per_s']:,.1f} "
              f"| {r['vs_hf']:.2f}x | {'yes' if r['same_tokens_as_hf'] else 'no'} |"
              for r in rows]
    return lines


def _verdict(value: Optional[float], target: float) -> str:
    return "not measured" if value is None else ("met" if value >= target else "not met")


def goals_list(record: dict) -> list[str]:
    """Issue 21's goals, each met, not met or not measured."""
    steps = _steps(record)
    lines = []
    for step, shape in THROUGHPUT_STEPS.items():
        figures = steps.get(step, {}).get("figures", {})
        goal = figures.get("goal", {})
        ratio, best = goal.get("ratios", {}).get(shape), goal.get("used", {}).get(shape)
        lines.append(f"- {shape}: ours >= 1.1x nanoGPT + torch.compile: {_verdict(ratio, 1.1)}"
                     f" ({_fmt(ratio, '.3f')} by {best})")
        if shape == "1.3b":
            mfu = goal.get("mfu_1_3b")
            lines.append(f"- 1.3b: ours >= 60% of the measured bf16 peak: {_verdict(mfu, 0.6)}"
                         f" ({_fmt(None if mfu is None else 100 * mfu, '.1f', '%')} by {best})")
    for step, what in (("llama-1b", "Llama 3.2 1B shape (bf16, sequence 2048)"),
                       ("moe", "8 experts top-2 at 12 x 768 (bf16, sequence 1024)")):
        figures = steps.get(step, {}).get("figures", {})
        if figures:
            mfu = figures.get("mfu")
            lines.append(f"- {what}: {_fmt(figures.get('tokens_per_s'), '.0f')} tokens/s, "
                         f"{_fmt(figures.get('tflops'), '.1f')} TFLOP/s, MFU "
                         f"{_fmt(None if mfu is None else 100 * mfu, '.1f', '%')}")
    rows = steps.get("generate", {}).get("figures", {}).get("rows", [])
    for batch in (1, 8):
        cached = [r["vs_hf"] for r in rows
                  if r["batch"] == batch and r["generator"] == "ours (KV cache)"]
        value = cached[0] if cached else None
        lines.append(f"- generation at batch {batch}: ours (KV cache) >= HF generate: "
                     f"{_verdict(value, 1.0)} ({_fmt(value, '.2f', 'x')})")
    return lines


def summary_markdown(record: dict) -> str:
    title = "# GPU check" + (" (dry run on the CPU: plumbing only)" if record["dry_run"] else "")
    parts = [title, "", machine_line(record), "", *steps_table(record), "", "## Checks", "",
             *checks_list(record), "", "## Goals", "", *goals_list(record), "",
             "## Throughput", "", *throughput_table(record), "",
             "## Generation", "", *generation_table(record)]
    return "\n".join(parts)
