"""Speed benchmark: llama_core against Hugging Face transformers' LlamaForCausalLM on the same random
weights, in one process, side by side.

    python scripts/bench.py --shape 15m                 # CPU shapes: 15m, 110m; GPU: 7b, 13b
    python scripts/bench.py --shape 7b --device cuda --quantize int8
    python scripts/bench.py --shape custom --dim 512 --n-layers 8 --n-heads 8 --n-kv-heads 2
    python scripts/bench.py --shape 110m --threads 2 --llama-cpp ~/.cache/llama-cpp-peer   # and llama.cpp

Reports batch-1 decode tokens/s, time to first token for several prompt lengths, aggregate tokens/s
for 8 and 32 concurrent sequences (decoding only, and with their 32-token prompts' prefill included,
32 new tokens each) and peak memory; on CUDA also the achieved weight bandwidth and its share of the
device-to-device copy bandwidth measured in the same run. With --llama-cpp, the same weights converted to
GGUF go through llama.cpp's llama-bench and llama-batched-bench in the same run (CPU, vocab-32000 shapes,
with the Llama-2 tokenizer the converter needs). Prints a table and writes the figures as JSON (--json).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llama_core.checkpoint import permute_rotary  # noqa: E402
from llama_core.config import ModelArgs  # noqa: E402
from llama_core.cpu_kernels import PanelLinear, to_panels  # noqa: E402
from llama_core.cpu_kernels import build as cpu_kernels_build  # noqa: E402
from llama_core.errors import LlamaError  # noqa: E402
from llama_core.generation import Llama  # noqa: E402
from llama_core.model import Transformer  # noqa: E402
from llama_core.int4 import quantize_int4  # noqa: E402
from llama_core.quantize import quantize_int8  # noqa: E402

LLAMA2_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "llama2" / "tokenizer.model"
BATCHED_PROMPT, BATCHED_NEW = 32, 32  # llama-batched-bench -npp 32 -ntg 32
AGREEMENT_PROMPT = 16
# Profiler events that make the host wait for the device, or move data between them.
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cudaMemcpyAsync", "aten::_local_scalar_dense")

SHAPES = {
    "15m": dict(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, multiple_of=32),
    "110m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, multiple_of=32),
    "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, multiple_of=256),
    "13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, multiple_of=256),
}


class _Vocab:
    """Stand-in tokenizer: the benchmark feeds token ids directly and never reaches EOS (id -1)."""

    bos_id, eos_id, pad_id = 1, -1, -1

    def __init__(self, n_words: int) -> None:
        self.n_words = n_words


# Environment variables that choose the CPU code a run measures: llama_core's kernels (build.py) and torch's
# own (ATen's dispatch, oneDNN, MKL), e.g. to measure an AVX2 machine's code on an AVX-512 one.
CPU_ENVIRONMENT = ("LLAMA_CORE_CPU_KERNELS", "LLAMA_CORE_CPU_TARGET", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                   "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="15m", choices=[*SHAPES, "custom"])
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab-size"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode measurement")
    p.add_argument("--prompt-lengths", default="128,512,2048", help="prompt lengths for time to first token")
    p.add_argument("--batch-sizes", default="8,32", help="concurrent sequences for aggregate throughput")
    p.add_argument("--decode-depths", default="", help="also batch-1 decode speed with this many tokens already "
                   "in the context, e.g. 1024,3072: a long chat's next reply (llama-bench -d)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    p.add_argument("--quantize", choices=["none", "int8", "int4"], default="none")
    p.add_argument("--with-float", action="store_true", help="with --quantize: also measure the float model, "
                   "side by side in the same run (llama_core_float)")
    p.add_argument("--with-compiled", action="store_true", help="also llama_core with its compiled decode step "
                   "(llama_core_compiled), side by side in the same run")
    p.add_argument("--with-torch-kernels", action="store_true", help="also llama_core with its own CPU kernels "
                   "turned off (LLAMA_CORE_CPU_KERNELS=0: torch's oneDNN, MKL and fbgemm products), side by side")
    p.add_argument("--stored", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="round the random weights to this dtype, as a checkpoint stored in it holds them (Llama-2's "
                        "are bfloat16 or float16): on CPU llama_core then keeps float32 models' projections in 16 bits")
    p.add_argument("--with-float32-panels", action="store_true", help="with --stored bfloat16/float16 on CPU: also "
                   "llama_core with the same weights in float32 panels (llama_core_float32_panels), side by side")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="llama_core's KV cache (auto: the model's dtype)")
    p.add_argument("--with-kv-cache-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="also llama_core with its KV cache in this dtype (llama_core_kv_DTYPE), side by side")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="llama_core's engines draft up to N tokens a step from the text so far (Engine's prompt_lookup; "
                        "default: 0, plain decoding, as the other implementations do; random weights' text repeats "
                        "unlike a real model's: scripts/bench_prompt_lookup.py measures drafting)")
    p.add_argument("--skip-hf", action="store_true", help="measure llama_core only")
    p.add_argument("--compile", action="store_true", help="llama_core with the static, torch.compile'd decode step")
    p.add_argument("--hf-compile", action="store_true", help="also HF with static cache + torch.compile")
    p.add_argument("--agreement-tokens", type=int, default=0, metavar="N",
                   help="also greedy-decode N tokens with llama_core and HF from one prompt and report how far they "
                        "agree: the identical prefix, and llama_core's top-1 under HF's tokens (teacher-forced)")
    p.add_argument("--count-syncs", action="store_true",
                   help="also count, with the torch profiler, what llama_core's batch-1 decode loop does per token "
                        "that makes the host wait: CUDA synchronisations, copies between host and device, .item()")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here (after each phase, "
                   "so a run killed partway leaves the figures it took)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="once this many seconds have passed since the start, skip the figures not yet taken "
                        "(checked at the end of each phase) and report what was measured")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR",
                   help="also run llama.cpp built in DIR by ../shared/peers/build_llama_cpp.sh")
    p.add_argument("--tokenizer", type=Path, default=LLAMA2_TOKENIZER,
                   help="Llama-2 tokenizer.model for the GGUF conversion (default: ../shared/llama2)")
    return p.parse_args()


def model_args(a: argparse.Namespace) -> ModelArgs:
    shape = dict(SHAPES.get(a.shape, SHAPES["15m"]))
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"):
        if getattr(a, key) is not None:
            shape[key] = getattr(a, key)
    if a.n_heads is not None and a.n_kv_heads is None:  # not the base shape's: no grouped-query attention
        shape["n_kv_heads"] = a.n_heads
    return ModelArgs(**shape, max_seq_len=4096)


def random_model(args: ModelArgs, device: torch.device, dtype: torch.dtype, stored: str = "float32") -> Transformer:
    """Random weights in dtype, each a value of the `stored` dtype (as a checkpoint stored in it)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() == 2 else torch.nn.init.ones_(p)
        p.data.copy_(p.data.to(getattr(torch, stored)))
    return model.requires_grad_(False).eval()


def hf_model(model: Transformer, attn: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    a = model.args
    config = LlamaConfig(
        hidden_size=a.dim, intermediate_size=a.hidden_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, vocab_size=a.vocab_size,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, max_position_embeddings=a.max_seq_len,
        tie_word_embeddings=False, attn_implementation=attn,
    )
    weight = model.tok_embeddings.weight
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    state = {"model.embed_tokens.weight": weight, "model.norm.weight": model.norm.weight, "lm_head.weight": model.output.weight}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        state[pre + "self_attn.q_proj.weight"] = permute_rotary(layer.attention.wq.weight, a.n_heads)
        state[pre + "self_attn.k_proj.weight"] = permute_rotary(layer.attention.wk.weight, a.n_kv_heads)
        state[pre + "self_attn.v_proj.weight"] = layer.attention.wv.weight
        state[pre + "self_attn.o_proj.weight"] = layer.attention.wo.weight
        state[pre + "mlp.gate_proj.weight"] = layer.feed_forward.w1.weight
        state[pre + "mlp.up_proj.weight"] = layer.feed_forward.w3.weight
        state[pre + "mlp.down_proj.weight"] = layer.feed_forward.w2.weight
        state[pre + "input_layernorm.weight"] = layer.attention_norm.weight
        state[pre + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
    hf.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True, strict=False)
    hf.model.rotary_emb.inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, device=weight.device).float() / a.head_dim))
    hf.model.rotary_emb.original_inv_freq = hf.model.rotary_emb.inv_freq
    return hf.to(weight.device).requires_grad_(False).eval()


def best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(impls: dict[str, Callable[[list[list[int]], int], None]], a, vocab: int, device: torch.device,
            engines: Optional[dict[str, Llama]] = None, results: Optional[dict] = None,
            phase_done: Callable[[str], None] = lambda phase: None) -> dict:
    """Decode speed, time to first token and batched throughput of each implementation. Each figure is
    taken for all implementations in turn, repeat after repeat, so they share the machine's conditions.
    engines: the Llama behind each llama_core implementation; decoding after a long context is timed on its
    engine's stream from the first token to the last, as subtracting two runs' times would leave mostly
    the long prompt's noise. The figures go into results (a new dict if None) as they are taken, and
    phase_done(name) is called after each phase ("decode", "ttft_128", "depth_2048", "batch_8", ...): it
    may save them, or raise to stop there."""
    gen = torch.Generator().manual_seed(1)

    def prompts(batch: int, length: int) -> list[list[int]]:
        return torch.randint(3, vocab, (batch, length), generator=gen).tolist()

    def best(make_call: Callable[[Callable], Callable[[], object]], repeats: int, only=None) -> dict[str, float]:
        chosen = {name: g for name, g in impls.items() if only is None or name in only}
        times = {name: float("inf") for name in chosen}
        for _ in range(repeats):
            for name, generate in chosen.items():
                times[name] = min(times[name], best_time(make_call(generate), 1, device))
        return times

    # Every call gets prompts of its own: a prompt seen before would be served from llama_core's prefix cache.
    n = a.decode_tokens
    results = {} if results is None else results
    for name in impls:
        results[name] = {"ttft_s": {}, "aggregate_tokens_per_s": {}, "aggregate_with_prefill_tokens_per_s": {}}
    for generate in impls.values():
        generate(prompts(1, 16), 2)  # warm-up
    first = best(lambda g: lambda: g(prompts(1, 16), 1), a.repeats)
    full = best(lambda g: lambda: g(prompts(1, 16), n + 1), a.repeats)
    for name in impls:
        results[name]["decode_tokens_per_s"] = n / max(full[name] - first[name], 1e-9)
    phase_done("decode")
    for length in _ints(a.prompt_lengths):
        for name, t in best(lambda g: lambda: g(prompts(1, length), 1), a.repeats).items():
            results[name]["ttft_s"][length] = t
        phase_done(f"ttft_{length}")
    engines = engines or {}
    for depth in _ints(a.decode_depths):
        others = [name for name in impls if name not in engines]
        t_first = best(lambda g: lambda: g(prompts(1, depth), 1), a.repeats, others)
        t_full = best(lambda g: lambda: g(prompts(1, depth), n + 1), a.repeats, others)
        decode_seconds = {name: float("inf") for name in engines}
        for _ in range(a.repeats):  # taking turns, as best() does
            for name, engine in engines.items():
                seconds = _decode_seconds(engine, prompts(1, depth)[0], n, device)
                decode_seconds[name] = min(decode_seconds[name], seconds)
        for name in impls:
            seconds = decode_seconds[name] if name in engines else t_full[name] - t_first[name]
            results[name].setdefault("decode_tokens_per_s_at_depth", {})[depth] = n / max(seconds, 1e-9)
        phase_done(f"depth_{depth}")
    for batch in _ints(a.batch_sizes):
        t_first = best(lambda g: lambda: g(prompts(batch, 16), 1), a.repeats)
        t_full = best(lambda g: lambda: g(prompts(batch, 16), n + 1), a.repeats)
        for name in impls:
            results[name]["aggregate_tokens_per_s"][batch] = batch * n / max(t_full[name] - t_first[name], 1e-9)
        for name, t in best(lambda g: lambda: g(prompts(batch, BATCHED_PROMPT), BATCHED_NEW), a.repeats).items():
            results[name]["aggregate_with_prefill_tokens_per_s"][batch] = batch * BATCHED_NEW / t
        phase_done(f"batch_{batch}")
    return results


def _decode_seconds(llama: Llama, prompt: list[int], n: int, device: torch.device) -> float:
    """Seconds from a greedy stream's first token to its (n + 1)th: n tokens decoded after the prompt."""
    stream = iter(llama.engine.submit(prompt, n + 1, temperature=0, logprobs=False))
    next(stream)
    start = time.perf_counter()
    for _ in stream:
        pass
    _sync(device)
    return time.perf_counter() - start


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x.strip()]


def export_for_llama_cpp(model: Transformer, a, folder: Path) -> Path:
    """The float weights in Hugging Face layout with the Llama-2 tokenizer: what llama.cpp's converter reads.
    (Before Llama.from_model, which fuses and packs the model's projections.)"""
    import shutil

    hf_dir = folder / "hf"
    hf_model(model).save_pretrained(hf_dir, safe_serialization=True)
    shutil.copy(a.tokenizer, hf_dir / "tokenizer.model")
    return hf_dir


def measure_llama_cpp(hf_dir: Path, a, report: dict) -> None:
    """The same weights in llama.cpp, f32, the 16-bit type they are stored in (--stored), and q8_0 with
    --quantize int8 or q4_0 with int4; figures as measure() gives."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp_peer import LlamaCpp

    peer = LlamaCpp(a.llama_cpp)
    threads = torch.get_num_threads()
    lengths = [int(x) for x in a.prompt_lengths.split(",")]
    batches = [int(x) for x in a.batch_sizes.split(",")]
    stored = {"bfloat16": ["bf16"], "float16": ["f16"]}.get(a.stored, [])
    for outtype in ["f32"] + stored + {"int8": ["q8_0"], "int4": ["q4_0"]}.get(a.quantize, []):
        print(f"llama.cpp {outtype} ...", flush=True)
        gguf = peer.convert(hf_dir, hf_dir.parent / f"model-{outtype}.gguf", outtype)
        batched = peer.batched(gguf, threads, batches, BATCHED_PROMPT, BATCHED_NEW)
        at_depth = {}
        if a.decode_depths:
            figures, settings = peer.decode_tokens_per_s_at_depth(gguf, threads, a.decode_tokens,
                                                                  _ints(a.decode_depths), a.repeats)
            at_depth = {"decode_tokens_per_s_at_depth": figures, "attention_settings": settings}
        report["results"][f"llama_cpp_{outtype}"] = {
            "decode_tokens_per_s": peer.decode_tokens_per_s(gguf, threads, a.decode_tokens, a.repeats),
            **at_depth,
            "ttft_s": peer.prompt_seconds(gguf, threads, lengths, a.repeats),
            "aggregate_tokens_per_s": {b: batched[b]["decode_tokens_per_s"] for b in batches},
            "aggregate_with_prefill_tokens_per_s": {b: batched[b]["tokens_per_s_with_prefill"] for b in batches},
        }
        gguf.unlink()
    report["llama_cpp"] = {"folder": str(peer.folder), "threads": threads,
                           "commands": "llama-bench -p 0 -n N; llama-bench -p L -n 0; "
                                       f"llama-batched-bench -npp {BATCHED_PROMPT} -ntg {BATCHED_NEW} -npl B"}


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak RSS so far


def peak_memory_each(impls: dict, a, vocab: int, device: torch.device) -> dict[str, int]:
    """On CUDA, each implementation's peak allocated memory over its largest batch (weights included)."""
    if device.type != "cuda":
        return {}
    batch = max(int(x) for x in a.batch_sizes.split(","))
    prompts = torch.randint(3, vocab, (batch, 16)).tolist()
    peaks = {}
    for name, generate in impls.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        generate(prompts, a.decode_tokens)
        peaks[name] = torch.cuda.max_memory_allocated(device)
    return peaks


def copy_bandwidth(device: torch.device) -> Optional[float]:
    """Device-to-device copy bandwidth in bytes/s (read + write), best of a few 1 GiB copies."""
    if device.type != "cuda":
        return None
    seconds = _copy_seconds(device)
    torch.cuda.empty_cache()  # the two GiB it copied
    return 2 * (1 << 30) / seconds


def _copy_seconds(device: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return best_time(lambda: dst.copy_(src), 5, device)


def max_logprob_deviation(reference: Transformer, quantized: Transformer, vocab: int, device) -> float:
    tokens = torch.randint(3, vocab, (1, 64), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.inference_mode():
        ref = torch.log_softmax(reference(tokens).float(), -1)
        out = torch.log_softmax(quantized(tokens).float(), -1)
    return float((ref - out).abs().max())


class DeadlinePassed(Exception):
    """--deadline passed: the figures not yet taken are skipped."""


class Progress:
    """Writes the report (--json) after every phase, so a run its caller kills at a time limit still leaves
    the figures it took, and stops the run at a phase's end once --deadline seconds have passed."""

    def __init__(self, report: dict, path: Optional[Path], seconds: Optional[float], started: float) -> None:
        self.report, self.path = report, path
        self.deadline = None if seconds is None else started + seconds

    def save(self) -> None:
        derive_figures(self.report)
        if self.path:
            self.path.write_text(json.dumps(self.report, indent=2) + "\n")

    def done(self, phase: str) -> None:
        self.report["phases_done"].append(phase)
        self.save()
        print(f"[{phase} done]", flush=True)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlinePassed(phase)


def derive_figures(report: dict) -> None:
    """Each implementation's achieved weight bandwidth and share of the copy bandwidth (on CUDA), and the
    ratios, from the figures taken so far."""
    bandwidth = report.get("copy_bandwidth_bytes_per_s")
    for name, result in report["results"].items():
        if bandwidth and "decode_tokens_per_s" in result:
            achieved = report["weight_bytes_read"].get(name, report["weight_bytes"]) * result["decode_tokens_per_s"]
            result["achieved_bandwidth_bytes_per_s"] = achieved
            result["share_of_copy_bandwidth"] = achieved / bandwidth
    report["ratios"] = ratios(report)


def main() -> None:
    started = time.monotonic()
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from llama_core.devices import resolve_device, resolve_dtype

    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    args = model_args(a)
    if a.llama_cpp is not None:
        if args.vocab_size != 32000 or not a.tokenizer.is_file() or device.type != "cpu" or dtype != torch.float32:
            raise LlamaError(f"--llama-cpp compares float32 on the CPU for a vocab-32000 shape, and needs the "
                             f"Llama-2 tokenizer at {a.tokenizer} (--tokenizer)")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from llama_cpp_peer import LlamaCpp, PeerError

        try:
            LlamaCpp(a.llama_cpp)
        except PeerError as exc:
            raise LlamaError(str(exc)) from None
    workdir = tempfile.TemporaryDirectory()
    max_len = max(max(_ints(a.prompt_lengths) + _ints(a.decode_depths)) + a.decode_tokens, BATCHED_PROMPT + BATCHED_NEW,
                  AGREEMENT_PROMPT + a.agreement_tokens) + 8
    max_batch = max(int(x) for x in a.batch_sizes.split(","))
    model = random_model(args, device, dtype, a.stored)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report = {
        "shape": a.shape, "args": args.to_dict(), "device": _device_name(device), "dtype": str(dtype).split(".")[-1],
        "threads": torch.get_num_threads(), "torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weight_bytes, "weight_bytes_read": {}, "stored": a.stored, "decode_tokens": a.decode_tokens,
        "quantize": a.quantize,
        "phases_done": [], "results": {},
    }
    if device.type == "cpu":  # what the CPU kernels were built for, and what torch's own CPU code is held to
        report["cpu_kernels_target"] = cpu_kernels_build.target() if cpu_kernels_build.expected() else None
        report["cpu_environment"] = {name: os.environ[name] for name in CPU_ENVIRONMENT if name in os.environ}
    print(f"{a.shape}: {report['parameters'] / 1e6:.1f}M parameters, {dtype}, {report['device']}, {report['threads']} threads", flush=True)
    progress = Progress(report, a.json, a.deadline, started)
    bandwidth = copy_bandwidth(device)  # first: the share of it is the headline figure on CUDA
    if bandwidth:
        report["copy_bandwidth_bytes_per_s"] = bandwidth
        print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    progress.save()

    hf_dir = None
    if a.llama_cpp is not None:
        hf_dir = export_for_llama_cpp(model, a, Path(workdir.name))
    hf = None if a.skip_hf else hf_model(model)
    reference = None
    if a.quantize != "none":
        reference = model
        quantized = {"int8": quantize_int8, "int4": quantize_int4}[a.quantize]
        model = quantized(random_model(args, device, dtype, a.stored))
        report[f"{a.quantize}_max_logprob_deviation"] = max_logprob_deviation(reference, model, args.vocab_size, device)
        report[f"weight_bytes_{a.quantize}"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    compiled_model = copy.deepcopy(model) if a.with_compiled else None  # before Llama fuses and packs model
    torch_kernels_model = copy.deepcopy(model) if a.with_torch_kernels else None
    float32_panels_model = copy.deepcopy(model) if a.with_float32_panels else None
    other_kv_model = copy.deepcopy(model) if a.with_kv_cache_dtype else None
    build_seconds: list[float] = []  # each Llama's making, its compiles and CUDA-graph captures included

    def llama_from_model(*args, **kwargs) -> Llama:
        started_build = time.perf_counter()
        built = Llama.from_model(*args, prompt_lookup=a.prompt_lookup, **kwargs)
        built.warm_up()  # on this thread, which runs every generation timed here
        build_seconds.append(time.perf_counter() - started_build)
        return built

    llama = llama_from_model(model, _Vocab(args.vocab_size), max_len, max_batch, compile=a.compile,
                             kv_cache_dtype=a.kv_cache_dtype)
    report["kv_cache_dtype"] = str(llama.runner.kv_cache_dtype).removeprefix("torch.")
    report["prompt_lookup"] = a.prompt_lookup
    impls: dict[str, Callable[[list[list[int]], int], None]] = {}
    engines: dict[str, Llama] = {}  # the Llama behind each llama_core implementation but torch's kernels

    def add(name: str, implementation: Llama) -> None:
        impls[name] = lambda p, n: implementation.generate(p, n, temperature=0)
        engines[name] = implementation
        report.setdefault("build_seconds", {})[name] = build_seconds[-1]
        compiled = " (compiled)" if implementation.runner.decode_step.compiled else ""
        print(f"{name}: made in {build_seconds[-1]:.1f} s{compiled}", flush=True)
        progress.save()  # a run killed later (a device call's limit) still says how long the making took

    add("llama_core", llama)
    if compiled_model is not None:
        add("llama_core_compiled", llama_from_model(compiled_model, _Vocab(args.vocab_size), max_len, max_batch,
                                                    compile=True))
    if torch_kernels_model is not None:
        with torch_kernels_only():
            torch_kernels = llama_from_model(torch_kernels_model, _Vocab(args.vocab_size), max_len, max_batch,
                                             compile=a.compile)

        def generate_with_torch_kernels(p, n):
            with torch_kernels_only():
                torch_kernels.generate(p, n, temperature=0)

        impls["llama_core_torch_kernels"] = generate_with_torch_kernels
    if float32_panels_model is not None:
        wide = llama_from_model(float32_panels_model, _Vocab(args.vocab_size), max_len, max_batch, compile=a.compile)
        for module in wide.model.modules():
            if isinstance(module, PanelLinear):
                module.panels = to_panels(module.weight)
        add("llama_core_float32_panels", wide)
    if other_kv_model is not None:
        add(f"llama_core_kv_{a.with_kv_cache_dtype}", llama_from_model(
            other_kv_model, _Vocab(args.vocab_size), max_len, max_batch, compile=a.compile,
            kv_cache_dtype=a.with_kv_cache_dtype))
    if reference is not None and a.with_float:
        add("llama_core_float", llama_from_model(reference, _Vocab(args.vocab_size), max_len, max_batch,
                                                 compile=a.compile))
    del reference
    if hf is not None:
        impls["hf_eager"] = lambda p, n: _hf_generate(hf, p, n)
    if a.quantize != "none":  # every llama_core implementation but the float one reads the quantized weights
        report["weight_bytes_read"] = {name: report[f"weight_bytes_{a.quantize}"] for name in engines
                                       if name != "llama_core_float"}

    def phase_done(phase: str) -> None:
        progress.done(phase)
        if phase == "decode" and a.count_syncs:  # right after the headline figure: what the decode loop waits on
            report["per_decoded_token"] = per_token_events(impls["llama_core"], args.vocab_size, a.decode_tokens,
                                                           device)
            progress.done("count_syncs")

    try:
        measure(impls, a, args.vocab_size, device, engines, report["results"], phase_done)
        if hf is not None and a.agreement_tokens > 0:
            report["greedy_agreement_with_hf"] = greedy_agreement(llama, hf, args.vocab_size, a.agreement_tokens)
            progress.done("agreement")
        if hf is not None and a.hf_compile:
            measure_hf_compiled(hf, impls["hf_eager"], a, args.vocab_size, device, report, progress)
        if hf_dir is not None:
            measure_llama_cpp(hf_dir, a, report)
        for name, peak in peak_memory_each(impls, a, args.vocab_size, device).items():
            report["results"][name]["peak_memory_bytes"] = peak
    except DeadlinePassed as exc:
        report["cut_short"] = f"--deadline {a.deadline:g} s had passed after phase '{exc}': the later figures were not taken"
        print(report["cut_short"], flush=True)
    # Peak memory of the whole run (on CPU: the process's peak resident set, both models included).
    report["peak_memory_bytes"] = _peak_memory(device)
    progress.save()
    print_table(report)


def measure_hf_compiled(hf, generate: Callable, a, vocab: int, device: torch.device, report: dict,
                        progress: Progress) -> None:
    """HF with its static cache under torch.compile ("reduce-overhead"): hf_static_compiled's figures."""
    try:
        hf.generation_config.cache_implementation = "static"
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        compiled_hf = {"hf_static_compiled": generate}
        # A first pass compiles (and records CUDA graphs) for every shape the figures use: one per prompt
        # length, batch size and number of new tokens (the static cache's length); then the figures.
        measure(compiled_hf, argparse.Namespace(**{**vars(a), "repeats": 1}), vocab, device)
        progress.done("hf_compiled_warm_up")
        measure(compiled_hf, a, vocab, device, results=report["results"],
                phase_done=lambda phase: progress.done(f"hf_compiled_{phase}"))
    except DeadlinePassed:
        raise
    except Exception as exc:  # compile support varies by version and device
        report["hf_compile_error"] = f"{type(exc).__name__}: {exc}"[:300]


def per_token_events(generate: Callable[[list[list[int]], int], None], vocab: int, tokens: int,
                     device: torch.device) -> dict[str, float]:
    """How often each of SYNC_EVENTS happens per token of batch-1 greedy decoding, from the torch profiler:
    (events generating tokens + 1 tokens - events generating 1) / tokens, so prefill and setup cancel out.
    On CUDA also device_busy_share: the kernels' time over the span from the first kernel to the last,
    while generating tokens + 1 (below 1 where the GPU waited for the host); and the kernels that took the
    most time are printed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    gen = torch.Generator().manual_seed(4)

    def profiled(n: int):
        prompt = torch.randint(3, vocab, (1, 16), generator=gen).tolist()  # fresh: no prefix-cache hit
        with profile(activities=activities) as prof:
            generate(prompt, n)
        return prof

    one = collections.Counter(event.name for event in profiled(1).events())
    prof = profiled(tokens + 1)
    many = collections.Counter(event.name for event in prof.events())
    per_token = {name: (many[name] - one[name]) / tokens for name in SYNC_EVENTS}
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:
        span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
        per_token["device_busy_share"] = sum(e.time_range.elapsed_us() for e in kernels) / max(span, 1)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
    return per_token


def greedy_agreement(llama: Llama, hf, vocab: int, tokens: int) -> dict:
    """Greedy continuations of one random prompt by llama_core and HF: the length of their identical prefix,
    and how often llama_core's most likely token is HF's, fed HF's continuation (teacher-forced)."""
    prompt = torch.randint(3, vocab, (1, AGREEMENT_PROMPT), generator=torch.Generator().manual_seed(3)).tolist()
    ours = llama.generate(prompt, tokens, temperature=0)[0][0]
    ids = torch.tensor(prompt, device=hf.device)
    with torch.inference_mode():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)[0, AGREEMENT_PROMPT:].tolist()
        sequence = torch.tensor([prompt[0] + theirs], device=llama.device)
        logits = llama.model(sequence, kv_len=sequence.shape[1])[0, AGREEMENT_PROMPT - 1 : -1]
    top1 = (logits.argmax(-1).cpu() == torch.tensor(theirs)).float().mean()
    identical = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    return {"tokens": tokens, "identical_prefix": identical, "teacher_forced_top1": float(top1)}


def ratios(report: dict) -> dict:
    """The comparisons the targets are stated in, from one run's figures."""
    results, out = report["results"], {}
    ours = results.get("llama_core", {})
    if "decode_tokens_per_s" not in ours:  # a run cut short before its first figure
        return out
    out["aggregate_over_batch1_decode"] = {b: t / ours["decode_tokens_per_s"]
                                           for b, t in ours["aggregate_tokens_per_s"].items()}
    for peer in ("hf_eager", "hf_static_compiled", "llama_cpp_f32", "llama_cpp_bf16", "llama_cpp_f16"):
        other = results.get(peer, {})
        if "decode_tokens_per_s" in other:
            out[f"decode_over_{peer}"] = ours["decode_tokens_per_s"] / other["decode_tokens_per_s"]
            if "decode_tokens_per_s_at_depth" in other:
                out[f"decode_at_depth_over_{peer}"] = {d: ours["decode_tokens_per_s_at_depth"][d] / t
                                                       for d, t in other["decode_tokens_per_s_at_depth"].items()}
            out[f"ttft_{peer}_over_ours"] = {n: other["ttft_s"][n] / t for n, t in ours["ttft_s"].items()
                                             if n in other["ttft_s"]}
    for other in ("llama_core_float", "llama_core_compiled", "llama_core_float32_panels",
                  *(n for n in results if n.startswith("llama_core_kv_"))):
        if "decode_tokens_per_s" in results.get(other, {}):
            out[f"decode_over_{other}"] = ours["decode_tokens_per_s"] / results[other]["decode_tokens_per_s"]
    if "share_of_copy_bandwidth" in ours:
        out["share_of_copy_bandwidth"] = ours["share_of_copy_bandwidth"]
    return out


@contextlib.contextmanager
def torch_kernels_only():
    """llama_core's own CPU kernels turned off while inside (int8 layers choose their kernel per call)."""
    before = os.environ.get("LLAMA_CORE_CPU_KERNELS")
    os.environ["LLAMA_CORE_CPU_KERNELS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LLAMA_CORE_CPU_KERNELS"]
        else:
            os.environ["LLAMA_CORE_CPU_KERNELS"] = before


def _hf_generate(hf, prompts: list[list[int]], n: int) -> None:
    ids = torch.tensor(prompts, device=hf.device)
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, eos_token_id=None)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def print_table(report: dict) -> None:
    results = report["results"]
    if not results:
        return
    names = list(results)
    rows = [("decode tok/s (batch 1)", lambda r: f"{r['decode_tokens_per_s']:.1f}")]
    for length in next(iter(results.values()))["ttft_s"]:
        rows.append((f"TTFT {length} tokens (ms)", lambda r, n=length: f"{1000 * r['ttft_s'][n]:.1f}"))
    for depth in next(iter(results.values())).get("decode_tokens_per_s_at_depth", {}):
        rows.append((f"decode tok/s at depth {depth}", lambda r, d=depth: f"{r['decode_tokens_per_s_at_depth'][d]:.1f}"))
    for batch in next(iter(results.values()))["aggregate_tokens_per_s"]:
        rows.append((f"aggregate tok/s ({batch} seqs)", lambda r, b=batch: f"{r['aggregate_tokens_per_s'][b]:.1f}"))
    for batch in next(iter(results.values())).get("aggregate_with_prefill_tokens_per_s", {}):
        rows.append((f"{batch} seqs, prefill included", lambda r, b=batch: f"{r['aggregate_with_prefill_tokens_per_s'][b]:.1f}"))
    if "peak_memory_bytes" in next(iter(results.values())):
        rows.append(("peak memory (MiB)", lambda r: f"{r['peak_memory_bytes'] / 2**20:.0f}" if "peak_memory_bytes" in r else "-"))
    if "copy_bandwidth_bytes_per_s" in report:
        rows.append(("weight bandwidth (GB/s)", lambda r: f"{r['achieved_bandwidth_bytes_per_s'] / 1e9:.0f}"))
        rows.append(("share of copy bandwidth", lambda r: f"{100 * r['share_of_copy_bandwidth']:.0f}%"))
    width = max(len(label) for label, _ in rows)

    def shown(cell: Callable[[dict], str], result: dict) -> str:
        try:
            return cell(result)
        except KeyError:  # not taken: the run was cut short (--deadline)
            return "-"

    print(f"\n{'':<{width}}  " + "  ".join(f"{n:>18}" for n in names))
    for label, cell in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{shown(cell, results[n]):>18}" for n in names))
    ours = results.get("llama_core", {})
    if "decode_tokens_per_s" not in ours:
        return
    other_caches = [n for n in results if n.startswith("llama_core_kv_")]
    for peer in ("hf_eager", "llama_core_float32_panels", *other_caches, "llama_cpp_f32", "llama_cpp_bf16",
                 "llama_cpp_f16", "llama_cpp_q8_0"):
        if peer in results:
            other = results[peer]
            ratios = [f"decode {ours['decode_tokens_per_s'] / other['decode_tokens_per_s']:.2f}x"]
            for depth, figure in other.get("decode_tokens_per_s_at_depth", {}).items():
                ratios.append(f"decode at depth {depth} {ours['decode_tokens_per_s_at_depth'][depth] / figure:.2f}x")
            for batch, figure in other.get("aggregate_with_prefill_tokens_per_s", {}).items():
                ratios.append(f"{batch} seqs with prefill {ours['aggregate_with_prefill_tokens_per_s'][batch] / figure:.2f}x")
            print(f"\nllama_core / {peer}: " + ", ".join(ratios))
    if "llama_core_torch_kernels" in results:
        ours, ref = results["llama_core"], results["llama_core_torch_kernels"]
        ratios = [f"decode {ours['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f}x"]
        for batch, figure in ref.get("aggregate_with_prefill_tokens_per_s", {}).items():
            ratios.append(f"{batch} seqs with prefill {ours['aggregate_with_prefill_tokens_per_s'][batch] / figure:.2f}x")
        print("\nllama_core / llama_core with torch's kernels: " + ", ".join(ratios))
    if "llama_core_float" in results:
        ours, ref = results["llama_core"], results["llama_core_float"]
        print(f"\n{report['quantize']} decode speed-up vs float (batch 1): "
              f"{ours['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f}x")
    print(f"peak memory of the run: {report['peak_memory_bytes'] / 2**20:.0f} MiB")
    if "per_decoded_token" in report:
        print("per decoded token: " + ", ".join(f"{name} {count:.2f}" for name, count in report["per_decoded_token"].items()
                                                if name != "device_busy_share"))
        if "device_busy_share" in report["per_decoded_token"]:
            print(f"GPU busy while decoding: {100 * report['per_decoded_token']['device_busy_share']:.1f}% of the time")
    if "greedy_agreement_with_hf" in report:
        g = report["greedy_agreement_with_hf"]
        print(f"greedy vs HF over {g['tokens']} tokens: identical for {g['identical_prefix']}, "
              f"teacher-forced top-1 agreement {100 * g['teacher_forced_top1']:.1f}%")
    for batch, ratio in report["ratios"]["aggregate_over_batch1_decode"].items():
        print(f"llama_core {batch} seqs aggregate / its batch-1 decode: {ratio:.2f}x")
    for name, value in report["ratios"].items():
        if name.startswith("ttft_") and value:
            print(f"time to first token, {name[len('ttft_'):-len('_over_ours')]} / llama_core: " + ", ".join(f"{n} tokens {r:.2f}x" for n, r in value.items()))
    for kind in ("int8", "int4"):
        if f"{kind}_max_logprob_deviation" in report:
            print(f"{kind} max |logprob - float logprob| over 64 positions: {report[f'{kind}_max_logprob_deviation']:.4f}")
    if "copy_bandwidth_bytes_per_s" in report:
        print(f"device copy bandwidth: {report['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s")


if __name__ == "__main__":
    try:
        main()
    except LlamaError as exc:  # a bad option (no CUDA, bad shape): one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
