"""Peak memory and time of loading a checkpoint: the process's host memory while it loads (anonymous, and
file-backed pages of the mmap'd weight files, sampled every few milliseconds) and, on CUDA, the device's
peak, against the bytes of the weights as loaded; then what the first request adds (layouts made on first use).

    python scripts/bench_load.py                          # 7B-wide, 4 blocks, stored bfloat16, each layout
    python scripts/bench_load.py --n-layers 8 --loads float32,float32+int8 --layouts meta2,hf
    python scripts/bench_load.py --ckpt-dir ~/llama/llama-2-13b --loads bfloat16 --device cuda

Without --ckpt-dir it writes a random checkpoint of the 7B's width (dim 4096, hidden 11008, vocab 32000)
with --n-layers blocks in bfloat16, as Meta and Hugging Face publish Llama-2, in each layout asked for:
"meta" (one consolidated.00.pth), "meta2" (two model-parallel shards, as 13B comes) and "hf"
(model.safetensors). Each load runs in a fresh process (`llama_core.loader.load`, max_seq_len 64, one
slot, so the KV cache is negligible); a load is a dtype, with "+int8" or "+int4" for `quantize=`.

Anonymous memory is what a load really needs; file-backed pages are the checkpoint's own, which the
kernel drops under pressure. "peak anon / weights" is the figure to keep near 1; "anon served" is the
anonymous memory once a first 4-token request has run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = ("meta", "meta2", "hf")
GiB = 1024 ** 3


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path, help="load this checkpoint instead of writing random ones")
    p.add_argument("--layouts", default="meta,meta2,hf", help=f"random checkpoints to write: any of {', '.join(LAYOUTS)}")
    p.add_argument("--loads", default="float32,float32+int8,bfloat16",
                   help="comma-separated loads: a dtype, with +int8 or +int4 for such weights")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared" / "llama2" / "tokenizer.model",
                   help="the Llama-2 tokenizer.model copied beside random checkpoints (any SentencePiece model "
                        "with vocab-size pieces)")
    p.add_argument("--json", type=Path, help="write the report here too")
    p.add_argument("--child", nargs=3, metavar=("CKPT", "DTYPE", "QUANTIZE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for load in a.loads.split(","):
        dtype, _, quantize = load.partition("+")
        if dtype not in ("float32", "bfloat16", "float16") or quantize not in ("", "int8", "int4"):
            p.error(f"--loads: {load!r} is not a dtype (float32, bfloat16, float16) with an optional +int8 or +int4")
    for layout in a.layouts.split(","):
        if layout not in LAYOUTS:
            p.error(f"--layouts: {layout!r} is not one of {', '.join(LAYOUTS)}")
    if a.ckpt_dir is None and a.child is None and not a.tokenizer.is_file():
        p.error(f"--tokenizer {a.tokenizer} not found: random checkpoints need a tokenizer.model beside them")
    return a


class MemorySampler(threading.Thread):
    """Samples this process's RssAnon and RssFile from /proc every interval seconds; keeps their peaks."""

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.interval, self.stopped = interval, threading.Event()
        self.peak_anon = self.peak_file = 0

    @staticmethod
    def read() -> dict[str, int]:
        fields = {}
        with open("/proc/self/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("RssAnon", "RssFile", "VmHWM"):
                    fields[name] = int(value.split()[0]) * 1024
        return fields

    def run(self) -> None:
        while not self.stopped.is_set():
            now = self.read()
            self.peak_anon = max(self.peak_anon, now["RssAnon"])
            self.peak_file = max(self.peak_file, now["RssFile"])
            time.sleep(self.interval)

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def child(ckpt: str, dtype: str, quantize: str, device: str) -> dict:
    """One load in this process: its time and memory."""
    import torch

    from llama_core import loader

    before = MemorySampler.read()
    sampler = MemorySampler()
    sampler.start()
    start = time.perf_counter()
    loaded = loader.load(ckpt, max_seq_len=64, max_batch_size=1, device=device, dtype=dtype, quantize=quantize or None)
    seconds = time.perf_counter() - start
    after = MemorySampler.read()
    from llama_core import Llama

    Llama(loaded).generate([[1, 2, 3]], 4, temperature=0)  # what a first request adds (kernels' layouts made on use)
    sampler.stop()
    served = MemorySampler.read()
    model = loaded.runner.model
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for name, t in [*model.named_parameters(), *model.named_buffers()] if "kv_cache" not in name}
    report = {
        "seconds": seconds, "weights_bytes": sum(tensors.values()), "parameters": loaded.info.parameter_count,
        "anon_before": before["RssAnon"], "peak_anon": max(sampler.peak_anon, after["RssAnon"], served["RssAnon"]),
        "peak_file": max(sampler.peak_file, after["RssFile"], served["RssFile"]), "peak_rss": served["VmHWM"],
        "anon_after": after["RssAnon"], "anon_after_first_request": served["RssAnon"],
    }
    if device == "cuda":
        report["cuda_peak"] = torch.cuda.max_memory_allocated()
        report["cuda_after"] = torch.cuda.memory_allocated()
    return report


def write_checkpoints(a: argparse.Namespace, folder: Path) -> dict[str, Path]:
    """Random bfloat16 checkpoints of the asked width, one folder per layout."""
    import shutil

    import torch

    from llama_core.checkpoint import META_SHARD_DIM
    from llama_core.config import ModelArgs
    from llama_core.export import export_hf
    from llama_core.model import Transformer

    params = {"dim": a.dim, "n_layers": a.n_layers, "n_heads": a.dim // 128, "vocab_size": a.vocab_size,
              "multiple_of": 256, "norm_eps": 1e-5}
    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = Transformer(ModelArgs(**params)).state_dict()
    state = {name: torch.randn(t.shape, dtype=torch.bfloat16) * 0.02 if t.dim() > 1 else torch.ones(t.shape, dtype=torch.bfloat16)
             for name, t in shapes.items()}
    shard_counts = {"meta": 1, "meta2": 2}
    dirs = {}
    for layout in {"meta", *a.layouts.split(",")} - {"hf"}:
        dirs[layout] = folder / layout
        dirs[layout].mkdir()
        (dirs[layout] / "params.json").write_text(json.dumps(params))
        shutil.copyfile(a.tokenizer, dirs[layout] / "tokenizer.model")
        n = shard_counts[layout]
        for i in range(n):  # Meta's model-parallel split: each projection cut along its own dimension
            shard = state if n == 1 else {
                name: t if t.dim() == 1 else t.chunk(n, META_SHARD_DIM[name.split(".")[-2]])[i].clone()
                for name, t in state.items()}
            torch.save(shard, dirs[layout] / f"consolidated.{i:02d}.pth")
            del shard
    del state
    if "hf" in a.layouts.split(","):
        dirs["hf"] = export_hf(dirs["meta"], folder / "hf").out_dir
    return {layout: dirs[layout] for layout in a.layouts.split(",")}


COLUMNS = [("checkpoint", "<12", lambda r: r["checkpoint"]), ("load", "<14", lambda r: r["load"]),
           ("seconds", ">8.1f", lambda r: r["seconds"]), ("weights GiB", ">12.2f", lambda r: r["weights_bytes"] / GiB),
           ("peak anon GiB", ">14.2f", lambda r: r["peak_anon"] / GiB),
           ("peak anon / weights", ">20.2f", lambda r: r["peak_anon"] / r["weights_bytes"]),
           ("anon served GiB", ">16.2f", lambda r: r["anon_after_first_request"] / GiB),
           ("peak file GiB", ">14.2f", lambda r: r["peak_file"] / GiB)]
CUDA_COLUMNS = [("GPU peak GiB", ">13.2f", lambda r: r["cuda_peak"] / GiB),
                ("GPU after GiB", ">14.2f", lambda r: r["cuda_after"] / GiB)]


def table_line(row: Optional[dict], cuda: bool) -> str:
    """The table's header (row None) or one row of it."""
    columns = COLUMNS + (CUDA_COLUMNS if cuda else [])
    if row is None:
        return " ".join(f"{title:{spec[:1]}{spec[1:].split('.')[0].rstrip('f')}}" for title, spec, _ in columns)
    return " ".join(f"{value(row):{spec}}" for _, spec, value in columns)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child, a.device)))
        return
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        if a.ckpt_dir is not None:
            dirs = {a.ckpt_dir.name: a.ckpt_dir}
        else:
            print(f"writing random checkpoints ({a.n_layers} blocks of dim {a.dim}, bfloat16): {a.layouts}", flush=True)
            dirs = write_checkpoints(a, Path(tmp))
        rows = []
        print(table_line(None, a.device == "cuda"), flush=True)
        for layout, ckpt in dirs.items():
            for load in a.loads.split(","):
                dtype, _, quantize = load.partition("+")
                result = subprocess.run([sys.executable, __file__, "--device", a.device, "--child", str(ckpt), dtype, quantize],
                                        capture_output=True, text=True)
                if result.returncode != 0:
                    sys.exit(f"loading {ckpt} as {load} failed:\n{result.stderr[-3000:]}")
                rows.append({"checkpoint": layout, "load": load, **json.loads(result.stdout.splitlines()[-1])})
                print(table_line(rows[-1], a.device == "cuda"), flush=True)
    report = {"device": a.device, "n_layers": a.n_layers, "dim": a.dim, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
