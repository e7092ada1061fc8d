"""llama.cpp as the peer of the CPU benchmarks: converts a Hugging Face folder to GGUF with llama.cpp's
own converter and runs its `llama-bench`, `llama-batched-bench` and `llama-server` on it.

DIR is where `../shared/peers/build_llama_cpp.sh DIR` built them: the tools in DIR/bin, the sources (with
convert_hf_to_gguf.py and gguf-py) in DIR/llama_cpp_python-*/vendor/llama.cpp. Nothing here downloads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Optional


class PeerError(RuntimeError):
    """llama.cpp is not where it was said to be, or one of its tools failed."""


class LlamaCpp:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).expanduser().resolve()
        self.bin = self.folder / "bin"
        sources = sorted(self.folder.glob("llama_cpp_python-*/vendor/llama.cpp"))
        missing = [t for t in ("llama-bench", "llama-batched-bench", "llama-server") if not (self.bin / t).is_file()]
        if missing or not sources:
            raise PeerError(f"no llama.cpp build in {self.folder} (missing: {', '.join(missing) or 'its sources'}); "
                            f"build it with: bash ../shared/peers/build_llama_cpp.sh {self.folder}")
        self.source = sources[-1]

    def tool(self, name: str) -> Path:
        return self.bin / name

    def convert(self, hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
        """hf_dir (config.json, safetensors, tokenizer.model) as a GGUF file of outtype: what the converter writes
        (f32, f16, bf16, q8_0), or q4_0, which llama-quantize makes from the f32 file (its default mix for q4_0:
        the output layer in q6_K)."""
        if outtype == "q4_0":
            wide = self.convert(hf_dir, out.with_name(out.stem + "-f32.gguf"), "f32")
            if not self.tool("llama-quantize").is_file():
                raise PeerError(f"no llama-quantize in {self.bin}: build it in {self.source}/build with "
                                "cmake --build build --target llama-quantize, and copy build/bin into that folder")
            result = subprocess.run([str(self.tool("llama-quantize")), str(wide), str(out), "q4_0"],
                                    capture_output=True, text=True)
            wide.unlink()
            if result.returncode != 0:
                raise PeerError(f"llama-quantize failed:\n{result.stderr[-2000:]}")
            return out
        env = dict(os.environ, PYTHONPATH=str(self.source / "gguf-py"))
        command = [sys.executable, str(self.source / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                   "--outfile", str(out)]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise PeerError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-2000:]}")
        return out

    def decode_tokens_per_s(self, gguf: Path, threads: int, tokens: int, repeats: int) -> float:
        """Batch-1 decode speed, `llama-bench -p 0 -n tokens` (mean of its repetitions)."""
        rows = self._bench(gguf, threads, repeats, "-p", "0", "-n", str(tokens))
        return rows[0]["avg_ts"]

    def decode_tokens_per_s_at_depth(self, gguf: Path, threads: int, tokens: int, depths: list[int],
                                      repeats: int) -> tuple[dict[int, float], dict]:
        """Batch-1 decode speed with `depth` tokens already in the context, `llama-bench -p 0 -n tokens -d depth`,
        with flash attention on and off (its default, auto, picks on for the CPU, and off measured faster at
        depth here): per depth the faster of the two, and each setting's figures (KV cache: its default f16)."""
        rows = self._bench(gguf, threads, repeats, "-p", "0", "-n", str(tokens), "-d", ",".join(map(str, depths)),
                           "-fa", "on,off")
        by_setting: dict[str, dict[int, float]] = {}
        for row in rows:
            by_setting.setdefault(f"flash_attn_{'on' if row['flash_attn'] in (1, True, 'on') else 'off'}", {})[
                row["n_depth"]] = row["avg_ts"]
        best = {depth: max(figures[depth] for figures in by_setting.values()) for depth in depths}
        return best, {**by_setting, "kv_cache": rows[0].get("type_k")}

    def prompt_seconds(self, gguf: Path, threads: int, lengths: list[int], repeats: int) -> dict[int, float]:
        """Time to process a prompt of each length in one batch, `llama-bench -p L -n 0`: what the first
        token waits for."""
        rows = self._bench(gguf, threads, repeats, "-p", ",".join(map(str, lengths)), "-n", "0")
        return {row["n_prompt"]: row["avg_ns"] / 1e9 for row in rows}

    def batched(self, gguf: Path, threads: int, sequences: list[int], prompt: int, new_tokens: int) -> dict[int, dict]:
        """`llama-batched-bench` with `sequences` independent sequences of prompt + new_tokens each: per count,
        decode-only tokens/s and generated tokens/s with the prefill included."""
        command = [str(self.tool("llama-batched-bench")), "-m", str(gguf), "-t", str(threads), "-c",
                   str(max(sequences) * (prompt + new_tokens) + 64), "-b", "2048", "-ub", "512",
                   "-npp", str(prompt), "-ntg", str(new_tokens), "-npl", ",".join(map(str, sequences)),
                   "--output-format", "jsonl"]
        out = self._run(command)
        figures = {}
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                figures[row["pl"]] = {"decode_tokens_per_s": row["speed_tg"],
                                      "tokens_per_s_with_prefill": row["pl"] * row["tg"] / row["t"]}
        return figures

    def server(self, gguf: Path, port: int, threads: int, slots: int, context: Optional[int] = None,
               log: Optional[IO[str]] = None) -> subprocess.Popen:
        """Starts `llama-server` on 127.0.0.1:port with `slots` parallel sequences, its log (a few lines per
        request) written to the file `log` or else dropped: a pipe nobody reads would fill and stop it. The
        caller stops it."""
        command = [str(self.tool("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(threads), "-tb", str(threads), "-np", str(slots), "--no-webui"]
        if context:
            command += ["-c", str(context * slots)]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log or subprocess.DEVNULL, text=True)

    def _bench(self, gguf: Path, threads: int, repeats: int, *extra: str) -> list[dict]:
        command = [str(self.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-r", str(repeats),
                   "-o", "json", *extra]
        return json.loads(self._run(command))

    @staticmethod
    def _run(command: list[str]) -> str:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise PeerError(f"{Path(command[0]).name} failed ({result.returncode}):\n{result.stderr[-2000:]}")
        return result.stdout
