"""The GPU targets, met or not, from the JSON reports scripts/gpu_check.sh writes into one folder.

    python scripts/gpu_summary.py docs/gpu/h100

Prints a Markdown table: each target, the figure measured, the report it comes from, and whether it is met.
A report that is missing (its step not run, or failed) leaves its rows "not measured".
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Optional

# Profiler events (scripts/bench.py --count-syncs) where the host waits until the device has run everything
# queued: the device then idles until the host queues more. The engine's one wait per step is on an event
# of the step before, with the next step already queued (serving.engine's overlap), counted apart.
DRAINING_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


REPORTS = ("7b_compiled", "7b_int8", "7b_engine32", "7b_hf_compiled", "7b_int4", "7b_eager")


def _load(folder: Path, name: str) -> Optional[dict]:
    path = folder / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows(folder: Path) -> list[tuple[str, str, str, str]]:
    """(target, measured, report, met) for each target of the GPU issue."""
    compiled, int8, engine32, hf_compiled, int4, eager = (_load(folder, name) for name in REPORTS)
    out = []

    def add(target: str, report: Optional[dict], source: str, value, fmt: str, met) -> None:
        if report is None or value is None:
            out.append((target, "not measured", source, "-"))
        else:
            out.append((target, fmt.format(value), source, "yes" if met(value) else "**no**"))

    def ratio(report, name):
        return None if report is None else report.get("ratios", {}).get(name)

    def decode(report, impl="llama_core"):
        return None if report is None else report["results"].get(impl, {}).get("decode_tokens_per_s")

    share = ratio(compiled, "share_of_copy_bandwidth")
    add("batch-1 compiled decode >= 85 % of copy bandwidth", compiled, "7b_compiled", share, "{:.1%}",
        lambda v: v >= 0.85)
    add("batch-1 compiled decode tokens/s (for reference)", compiled, "7b_compiled", decode(compiled), "{:.1f}",
        lambda v: True)
    add(">= 5x HF eager at batch 1 (compiled)", compiled, "7b_compiled", ratio(compiled, "decode_over_hf_eager"),
        "{:.2f}x", lambda v: v >= 5)
    if hf_compiled is not None and "hf_static_compiled" in hf_compiled["results"]:
        add("HF static cache + torch.compile, batch-1 tokens/s (reported)", hf_compiled, "7b_hf_compiled",
            decode(hf_compiled, "hf_static_compiled"), "{:.1f}", lambda v: True)
    else:
        add("HF static cache + torch.compile, batch-1 tokens/s (reported)", hf_compiled, "7b_hf_compiled",
            None if hf_compiled is None else hf_compiled.get("hf_compile_error", None), "{}", lambda v: False)
    add("int8 >= 1.7x bf16 compiled decode", int8, "7b_int8", ratio(int8, "decode_over_llama_core_float"),
        "{:.2f}x", lambda v: v >= 1.7)
    add("int8 largest logprob deviation from bf16 (reported)", int8, "7b_int8",
        None if int8 is None else int8.get("int8_max_logprob_deviation"), "{:.3f}", lambda v: True)
    kernels = _load(folder, "int8_kernels")
    if kernels is not None:  # per projection: what the int8 products alone give a one-row forward
        forward = kernels.get("forward_us", {})
        for variant in ("int8_triton", "int8_inductor"):
            us, bf16 = forward.get(f"1:{variant}"), forward.get("1:bf16")
            add(f"a 7B forward's products at one row, {variant} over bf16 (reported)", kernels, "int8_kernels",
                bf16 / us if us and bf16 else None, "{:.2f}x", lambda v: True)
    if int4 is not None:  # an optional step
        add("int4 over bf16 compiled decode (reported)", int4, "7b_int4", ratio(int4, "decode_over_llama_core_float"),
            "{:.2f}x", lambda v: True)
        add("int4 largest logprob deviation from bf16 (reported)", int4, "7b_int4",
            int4.get("int4_max_logprob_deviation"), "{:.3f}", lambda v: True)
    def aggregate_of(report, batch):  # None where the report has no such figure (a run cut short before it)
        return None if report is None else report["results"].get("llama_core", {}).get("aggregate_tokens_per_s", {}).get(batch)

    aggregate = aggregate_of(engine32, "32")
    batch1 = decode(compiled)
    add("engine, 32 sequences >= 12x its batch-1 decode", engine32, "7b_engine32 / 7b_compiled",
        aggregate / batch1 if aggregate and batch1 else None, "{:.1f}x", lambda v: v >= 12)
    eight = aggregate_of(engine32, "8")
    add("engine, 8 sequences (the app's default batch), tokens/s (reported)", engine32, "7b_engine32", eight,
        "{:.0f}", lambda v: True)
    # The static step runs only the rows it needs: a lone request in a 32-slot engine decodes as in a one-slot one.
    alone = decode(engine32)
    add("one sequence in the 32-slot engine >= 0.9x the one-slot engine's decode", engine32, "7b_engine32 / 7b_compiled",
        alone / batch1 if alone and batch1 else None, "{:.2f}x", lambda v: v >= 0.9)
    if eager is not None:  # an optional step
        add("uncompiled decode at batch 1, the app's default (reported)", eager, "7b_eager", decode(eager), "{:.1f}",
            lambda v: True)
    ttft = ratio(compiled, "ttft_hf_eager_over_ours") or {}
    for length in ("128", "512", "2048"):
        add(f"time to first token, {length}-token prompt, no slower than HF eager", compiled, "7b_compiled",
            ttft.get(length), "{:.2f}x HF's speed", lambda v: v >= 1.0)
    per_token = None if compiled is None else compiled.get("per_decoded_token")
    waits = None if per_token is None else sum(per_token.get(name, 0.0) for name in DRAINING_WAITS)
    add("no host synchronisation per decoded token (compiled)", compiled, "7b_compiled", waits,
        "{:.2f} waits per token", lambda v: v < 0.05)
    add("waits on the step before, the next one queued (reported)", compiled, "7b_compiled",
        None if per_token is None else per_token.get("cudaEventSynchronize"), "{:.2f} per token", lambda v: True)
    add("GPU busy while decoding at batch 1, compiled (reported)", compiled, "7b_compiled",
        None if per_token is None else per_token.get("device_busy_share"), "{:.1%}", lambda v: True)
    agreement = None if compiled is None else compiled.get("greedy_agreement_with_hf")
    add("bf16 greedy agreement with HF bf16 over 256 tokens (reported)", compiled, "7b_compiled", agreement,
        "{0[identical_prefix]} identical, {0[teacher_forced_top1]:.1%} top-1 teacher-forced", lambda v: True)
    return out


def logs(folder: Path) -> list[str]:
    """What the device log says (nvidia-smi's line, then Python, torch, CUDA, transformers and accelerate), and
    each test log's pytest summary, as lines."""
    out = []
    device = folder / "device.log"
    if device.is_file():
        lines = [line for line in device.read_text().splitlines() if line.strip()]
        out += [f"device: {line}" for line in lines[1:]]  # below nvidia-smi's header
    for name in ("tests_cuda", "tests"):
        log = folder / f"{name}.log"
        if log.is_file():
            summaries = re.findall(r"^=+ (.+ in [\d.]+s.*?) =+$", log.read_text(), re.MULTILINE)
            out.append(f"{name}: {summaries[-1] if summaries else 'no pytest summary (cut short?)'}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="where gpu_check.sh wrote its reports")
    folder = p.parse_args().folder
    device = next((r["device"] for r in map(lambda n: _load(folder, n), REPORTS)
                   if r is not None), "unknown device")
    print(f"{device}, reports in {folder}\n")
    for line in logs(folder):
        print(line)
    print()
    print("| target | measured | report | met |")
    print("| --- | --- | --- | --- |")
    for row in rows(folder):
        print("| " + " | ".join(row) + " |")
    for name in REPORTS:
        report = _load(folder, name)
        if report is not None and "cut_short" in report:
            print(f"\n{name} was cut short: {report['cut_short']} (phases done: {', '.join(report['phases_done'])})")


if __name__ == "__main__":
    main()
