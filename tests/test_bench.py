"""Smoke tests of the benchmark scripts on tiny settings, so they keep running (figures are not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *arguments: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *arguments], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("extra", [[], ["--quantize", "int8"], ["--stored", "bfloat16", "--with-float32-panels"]],
                         ids=["float32", "int8", "bfloat16-stored"])
def test_bench_reports_every_figure_for_both_implementations(tmp_path, extra):
    report_path = tmp_path / "report.json"
    result = _run("bench.py", "--shape", "custom", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
                  "--n-kv-heads", "2", "--vocab-size", "256", "--prompt-lengths", "8,16", "--batch-sizes", "2",
                  "--decode-tokens", "4", "--repeats", "1", "--threads", "1", "--json", str(report_path),
                  "--count-syncs", "--agreement-tokens", "24", *extra)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert set(report["per_decoded_token"]) >= {"cudaStreamSynchronize", "aten::_local_scalar_dense"}
    agreement = report["greedy_agreement_with_hf"]
    assert agreement["tokens"] == 24 and 0 <= agreement["identical_prefix"] <= 24
    if "int8" not in extra:  # float32 on the same weights: the same greedy tokens
        assert agreement["identical_prefix"] == 24 and agreement["teacher_forced_top1"] == 1.0
    ratios = report["ratios"]
    assert ratios["decode_over_hf_eager"] == pytest.approx(
        report["results"]["llama_core"]["decode_tokens_per_s"] / report["results"]["hf_eager"]["decode_tokens_per_s"])
    assert set(ratios["ttft_hf_eager_over_ours"]) == {"8", "16"} and set(ratios["aggregate_over_batch1_decode"]) == {"2"}
    assert set(report["results"]) == {"llama_core", "hf_eager"} | ({"llama_core_float32_panels"} if "--stored" in extra else set())
    for figures in report["results"].values():
        assert figures["decode_tokens_per_s"] > 0
        assert set(figures["ttft_s"]) == {"8", "16"} and all(t > 0 for t in figures["ttft_s"].values())
        assert set(figures["aggregate_tokens_per_s"]) == {"2"}
        assert set(figures["aggregate_with_prefill_tokens_per_s"]) == {"2"}
        assert figures["aggregate_with_prefill_tokens_per_s"]["2"] > 0
    assert report["peak_memory_bytes"] > 0 and report["parameters"] > 0
    assert report["args"]["n_kv_heads"] == 2
    if "int8" in extra:
        assert 0 < report["int8_max_logprob_deviation"] < 1.0
        assert report["weight_bytes_int8"] < report["weight_bytes"]
    if "--stored" in extra:
        assert report["stored"] == "bfloat16" and ratios["decode_over_llama_core_float32_panels"] > 0
        assert "llama_core / llama_core_float32_panels: decode " in result.stdout
    assert "llama_core / hf_eager: decode " in result.stdout
    assert report["phases_done"] == ["decode", "count_syncs", "ttft_8", "ttft_16", "batch_2", "agreement"]
    assert "cut_short" not in report


def test_bench_past_its_deadline_reports_the_figures_it_took(tmp_path):
    report_path = tmp_path / "report.json"
    result = _run("bench.py", "--shape", "custom", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
                  "--vocab-size", "256", "--prompt-lengths", "8,16", "--batch-sizes", "2", "--decode-tokens", "4",
                  "--repeats", "1", "--threads", "1", "--json", str(report_path), "--count-syncs",
                  "--agreement-tokens", "8", "--deadline", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    # The deadline is checked at the end of each phase: the first one's figures are in, nothing after them.
    assert report["phases_done"] == ["decode"]
    assert report["cut_short"] == ("--deadline 0 s had passed after phase 'decode': the later figures were not taken")
    for figures in report["results"].values():
        assert figures["decode_tokens_per_s"] > 0 and figures["ttft_s"] == {}
    assert "per_decoded_token" not in report and "greedy_agreement_with_hf" not in report
    assert report["ratios"]["decode_over_hf_eager"] > 0
    table = result.stdout.split(report["cut_short"])[1]
    assert "decode tok/s (batch 1)" in table and "TTFT" not in table


def test_bench_decodes_after_a_long_context_with_each_kv_cache(tmp_path):
    report_path = tmp_path / "report.json"
    result = _run("bench.py", "--shape", "custom", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
                  "--n-kv-heads", "2", "--vocab-size", "256", "--prompt-lengths", "8", "--batch-sizes", "2",
                  "--decode-tokens", "4", "--repeats", "1", "--threads", "1", "--json", str(report_path),
                  "--decode-depths", "16,100", "--kv-cache-dtype", "float16", "--with-kv-cache-dtype", "float32")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert set(report["results"]) == {"llama_core", "llama_core_kv_float32", "hf_eager"}
    assert report["kv_cache_dtype"] == "float16"
    for figures in report["results"].values():
        assert set(figures["decode_tokens_per_s_at_depth"]) == {"16", "100"}
        assert all(t > 0 for t in figures["decode_tokens_per_s_at_depth"].values())
    assert report["ratios"]["decode_over_llama_core_kv_float32"] > 0
    assert "decode tok/s at depth 100" in result.stdout
    assert "llama_core / llama_core_kv_float32: decode " in result.stdout and "decode at depth 100 " in result.stdout


def test_bench_measures_hf_compiled_after_compiling_every_shape(tmp_path):
    report_path = tmp_path / "report.json"
    result = _run("bench.py", "--shape", "custom", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
                  "--n-kv-heads", "2", "--vocab-size", "256", "--prompt-lengths", "8", "--batch-sizes", "2",
                  "--decode-tokens", "8", "--repeats", "1", "--threads", "1", "--hf-compile", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert "hf_compile_error" not in report
    compiled, eager = report["results"]["hf_static_compiled"], report["results"]["hf_eager"]
    # Compiling inside a timed run made these figures absurd (0.5 tokens/s, or 1e10 when the difference of
    # two timings came out near zero): they must be of the same order as HF eager's.
    for figure in ("decode_tokens_per_s",):
        assert eager[figure] / 20 < compiled[figure] < eager[figure] * 20
    assert eager["aggregate_tokens_per_s"]["2"] / 20 < compiled["aggregate_tokens_per_s"]["2"] < eager["aggregate_tokens_per_s"]["2"] * 20
    assert set(report["ratios"]["ttft_hf_static_compiled_over_ours"]) == {"8"}


def test_bench_counts_events_per_decoded_token():
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def generate(prompts, n):  # reads a value back to the host once per token, twice in its set-up
        for _ in range(n + 2):
            torch.ones(3).sum().item()

    counts = bench.per_token_events(generate, 100, 6, torch.device("cpu"))
    assert counts["aten::_local_scalar_dense"] == 1.0
    assert counts["cudaStreamSynchronize"] == 0.0


@pytest.mark.parametrize("through", [["--engine-only"], ["--client", "http"]], ids=["engine", "app-http"])
def test_serving_bench_reports_serial_and_batched(tmp_path, through):
    report_path = tmp_path / "serving.json"
    result = _run("bench_serving.py", *through, "--clients", "2", "--slots", "2", "--requests", "1",
                  "--max-new-tokens", "4", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    for name in ("serial", "batched"):
        figures = report[name]
        assert figures["requests"] == 2 and not figures["errors"]
        assert figures["aggregate_tokens_per_s"] > 0 and figures["ttft_p50_s"] > 0
    assert report["batched_over_serial"] > 0
    assert report["ttft_p50_s_median_of_runs"] == {name: report[name]["ttft_p50_s"] for name in ("serial", "batched")}
    assert "time to first token, median of the runs' p50s: serial " in result.stdout


def test_fairness_bench_reports_each_rule_in_each_scenario(tmp_path):
    report_path = tmp_path / "fairness.json"
    result = _run("bench_fairness.py", "--seconds", "0.3", "--heavy-prompt", "16", "--heavy-new", "4",
                  "--light-new", "4", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    for scenario in ("chat", "busy"):
        for rule in ("tokens", "requests", "fcfs"):
            figures = report["results"][scenario][rule]
            assert figures["light_requests"] > 0 and figures["heavy_tokens_per_s"] > 0
        assert set(report["ratios"][f"{scenario}: requests / tokens"]) >= {"light_done_p50", "light_ttft_p50"}
    assert "busy      requests" in result.stdout


def test_serving_bench_compares_the_app_with_gradio_alone_after_serving_requests_first(tmp_path):
    report_path = tmp_path / "floor.json"
    result = _run("bench_serving.py", "--gradio-floor", "--client", "http", "--clients", "2", "--slots", "2",
                  "--requests", "1", "--max-new-tokens", "4", "--served-before", "4", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    for name in ("gradio_floor", "llama_core"):
        figures = report[name]
        assert figures["requests"] == 2 and not figures["errors"] and figures["ttft_p50_s"] > 0
        assert report["served_before"][name]["requests"] == 4 and not report["served_before"][name]["errors"]
    assert report["gradio_floor"]["tokens"] == 2 * 4  # the canned replies are max_new_tokens long
    assert report["llama_core_over_gradio_floor"] > 0
    assert "gradio_floor first served 4 one-token requests" in result.stdout
    refused = _run("bench_serving.py", "--gradio-floor", "--client", "openai")
    assert refused.returncode == 2 and "--gradio-floor compares Gradio routes" in refused.stderr


def test_gemm_bench_prints_a_time_for_every_layout_and_row_count():
    result = _run("bench_gemm.py", "--shape", "tiny", "--rows", "1,4", "--repeats", "1", "--threads", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    from llama_core import cpu_kernels
    from llama_core.packed_linear import packing_available

    layouts = ["row", "column"] + (["onednn"] if packing_available() else []) + (["panels"] if cpu_kernels.available() else [])
    assert all(f"{stacking}, {layout}" in lines[1] for stacking in ("fused", "separate") for layout in layouts)
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "4"]
    assert all(len(r) == 1 + 2 * len(layouts) and all(float(t) > 0 for t in r[1:]) for r in rows)


def test_attention_bench_runs_from_a_checkout_without_pythonpath():
    """`python scripts/bench_attention.py` as the docs run it: no PYTHONPATH, llama_core not installed."""
    from llama_core import cpu_kernels

    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "scripts/bench_attention.py", "--threads", "1", "--length", "64",
                             "--shapes", "110m", "--dtypes", "float32", "--repeats", "1"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert "ModuleNotFoundError" not in result.stderr, result.stderr[-2000:]
    if not cpu_kernels.available():
        assert result.returncode == 1 and "the CPU kernels are not built here" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == "1 threads, 64 positions" and "110m" in result.stdout.splitlines()[1]


def test_int8_bench_prints_every_kernel_and_the_deviation():
    result = _run("bench_int8.py", "--shapes", "tiny", "--rows", "1,4", "--repeats", "1", "--threads", "1",
                  "--kernels", "fp32,dequant,fbgemm,llama_core", "--accuracy", "default")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rows"])
    assert lines[header].split() == ["rows", "fp32", "dequant", "fbgemm", "llama_core"]
    for line, rows in zip(lines[header + 1 : header + 3], ("1", "4")):
        cells = line.split()
        assert cells[0] == rows and all(float(t) > 0 for t in cells[1::2])
    assert lines[header + 3].split()[0] == "err"
    assert lines[-1].startswith("embedded default: max |int8 - float32 logprob| ")


@pytest.mark.parametrize("mode, expected", [
    (["--rows", "2", "--new-tokens", "6", "--top-ops", "3"], "median ms per step"),
    (["--riders", "2", "--rider-tokens", "5"], "2 prompts of 5 tokens riding one decoding row"),
    (["--rows", "2", "--new-tokens", "6", "--engine-thread"], "2 rows decoding in the engine's own thread"),
], ids=["decode-step", "riders", "engine-thread"])
def test_step_profile_prints_its_figures(mode, expected):
    result = _run("profile_step.py", "--threads", "1", *mode)
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout, result.stdout[-2000:]
    if "--engine-thread" in mode:
        figures = result.stdout.split("thread(s): ")[1].split(" ms per step")[0].split(", ")
        assert len(figures) == 3 and all(float(ms) > 0 for ms in figures)


def test_bench_answers_a_bad_device_with_one_line():
    result = _run("bench.py", "--shape", "custom", "--dim", "64", "--n-layers", "1", "--n-heads", "4",
                  "--device", "tpu:0", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: device must be 'auto', 'cpu' or 'cuda[:N]', got 'tpu:0'"
    ]


@pytest.mark.parametrize("script, flag", [("bench.py", "--llama-cpp"), ("bench_serving.py", "--llama-server")])
def test_a_missing_llama_cpp_build_is_one_line_naming_how_to_build_it(tmp_path, script, flag):
    extra = ["--shape", "15m"] if script == "bench.py" else []
    result = _run(script, *extra, flag, str(tmp_path / "nowhere"), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no llama.cpp build in ")
    assert "build_llama_cpp.sh" in lines[0]


LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "~/.cache/llama-cpp-peer")).expanduser()
LLAMA2_TOKENIZER = ROOT.parent / "shared" / "llama2" / "tokenizer.model"


def test_bench_runs_llama_cpp_on_the_same_weights(tmp_path):
    if not (LLAMA_CPP_DIR / "bin" / "llama-bench").is_file():
        pytest.skip(f"no llama.cpp build in {LLAMA_CPP_DIR} (set LLAMA_CPP_DIR; ../shared/peers/build_llama_cpp.sh builds it)")
    if not LLAMA2_TOKENIZER.is_file():
        pytest.skip(f"../shared not present: no Llama-2 tokenizer at {LLAMA2_TOKENIZER}")
    report_path = tmp_path / "report.json"
    result = _run("bench.py", "--shape", "custom", "--dim", "64", "--n-layers", "1", "--n-heads", "4",
                  "--n-kv-heads", "2", "--vocab-size", "32000", "--prompt-lengths", "8", "--batch-sizes", "2", "--decode-tokens", "4",
                  "--repeats", "1", "--threads", "1", "--skip-hf", "--llama-cpp", str(LLAMA_CPP_DIR),
                  "--json", str(report_path), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(report_path.read_text())["results"]["llama_cpp_f32"]
    assert figures["decode_tokens_per_s"] > 0 and figures["ttft_s"]["8"] > 0
    assert figures["aggregate_tokens_per_s"]["2"] > 0 and figures["aggregate_with_prefill_tokens_per_s"]["2"] > 0
    assert "llama_core / llama_cpp_f32: decode " in result.stdout


def test_gpu_check_runs_the_steps_asked_for_and_carries_the_shared_files(tmp_path):
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "gpu_check.sh").write_text((ROOT / "scripts" / "gpu_check.sh").read_text())
    shared = tmp_path / "shared"
    (shared / "models" / "stories260K").mkdir(parents=True)
    (shared / "models" / "stories260K" / "params.json").write_text("{}")
    (shared / "llama2").mkdir()
    (shared / "llama2" / "tokenizer.model").write_bytes(b"sp")

    def gpu_check(*arguments, env=None):
        return subprocess.run(["bash", str(work / "scripts" / "gpu_check.sh"), *arguments], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, LLAMA_SHARED_DIR=str(shared), **(env or {})))

    steps = gpu_check("--list").stdout.splitlines()
    assert steps == ["device", "tests_cuda", "7b_engine32", "int8_kernels", "7b_int8", "7b_compiled", "7b_eager (optional)",
                     "tests (optional)",
                     "7b_hf_compiled (optional)", "load_7b (optional)", "7b_int4 (optional)"]
    assert gpu_check("--carry").returncode == 0
    assert (work / ".gpu-shared" / "models" / "stories260K" / "params.json").read_text() == "{}"
    assert (work / ".gpu-shared" / "llama2" / "tokenizer.model").read_bytes() == b"sp"
    unknown = gpu_check(str(tmp_path / "out"), "7b_everything")
    assert unknown.returncode == 2 and "unknown step: 7b_everything" in unknown.stderr
    # One step, failing here for want of a GPU: its log is written and the script says how it ended.
    device = gpu_check(str(tmp_path / "out"), "device")
    assert "== device: exit" in device.stdout and (tmp_path / "out" / "device.log").is_file()
    assert not (tmp_path / "out" / "tests_cuda.log").exists()
    # A budget with less than a minute left skips the step, saying so, and writes nothing for it.
    skipped = gpu_check(str(tmp_path / "out"), "7b_compiled", "tests_cuda", env={"GPU_CHECK_BUDGET_S": "59"})
    assert skipped.returncode == 0
    assert "== 7b_compiled: skipped, 59 s of the 59 s budget left" in skipped.stdout
    assert "== tests_cuda: skipped" in skipped.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device.log"]


def test_gpu_checks_benchmark_steps_run_their_options_through_on_a_tiny_model(tmp_path):
    """The benchmark steps of gpu_check.sh with their exact options, on a tiny shape on the CPU: every phase of
    each runs, and each report holds what gpu_summary.py reads (a device call must not be spent finding
    that an option combination fails)."""
    tiny = (f"{sys.executable} scripts/bench.py --shape custom --dim 64 --n-layers 2 --n-heads 4 --vocab-size 512 "
            "--device cpu --threads 1")
    result = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path), "7b_compiled", "7b_int8", "7b_engine32",
                             "7b_int4", "7b_eager"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env=dict(os.environ, GPU_CHECK_BENCH=tiny, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:]
    for step in ("7b_compiled", "7b_int8", "7b_engine32", "7b_int4", "7b_eager"):
        assert f"== {step}: exit 0 " in result.stdout, result.stdout[-3000:]
        report = json.loads((tmp_path / f"{step}.json").read_text())
        assert "cut_short" not in report and report["phases_done"][0] == "decode", step
    compiled = json.loads((tmp_path / "7b_compiled.json").read_text())
    assert compiled["phases_done"] == ["decode", "count_syncs", "ttft_128", "ttft_512", "ttft_2048", "batch_1",
                                       "agreement"]
    assert "decode_over_hf_eager" in compiled["ratios"] and compiled["greedy_agreement_with_hf"]["tokens"] == 256
    int8 = json.loads((tmp_path / "7b_int8.json").read_text())
    assert int8["ratios"]["decode_over_llama_core_float"] > 0 and "int8_max_logprob_deviation" in int8
    engine32 = json.loads((tmp_path / "7b_engine32.json").read_text())
    assert engine32["results"]["llama_core"]["aggregate_tokens_per_s"]["32"] > 0
    assert engine32["results"]["llama_core"]["aggregate_tokens_per_s"]["8"] > 0
    assert engine32["phases_done"][-2:] == ["batch_32", "batch_8"]
    int4 = json.loads((tmp_path / "7b_int4.json").read_text())
    assert int4["ratios"]["decode_over_llama_core_float"] > 0 and int4["int4_max_logprob_deviation"] > 0
    summary = _run("gpu_summary.py", str(tmp_path))
    assert "| int4 over bf16 compiled decode (reported) | " in summary.stdout
    assert "| uncompiled decode at batch 1, the app's default (reported) | " in summary.stdout
    assert "| engine, 8 sequences (the app's default batch), tokens/s (reported) | " in summary.stdout
    unmeasured = [line.split(" | ")[0].lstrip("| ") for line in summary.stdout.splitlines() if "not measured" in line]
    # On the CPU there is no copy bandwidth and no GPU to be busy; HF compiled is an optional step.
    assert summary.returncode == 0 and unmeasured == [
        "batch-1 compiled decode >= 85 % of copy bandwidth",
        "HF static cache + torch.compile, batch-1 tokens/s (reported)",
        "GPU busy while decoding at batch 1, compiled (reported)"], summary.stdout


def test_gpu_summary_marks_each_target_met_or_not(tmp_path):
    compiled = {"device": "NVIDIA H100 80GB HBM3",
                "results": {"llama_core": {"decode_tokens_per_s": 200.0, "aggregate_tokens_per_s": {"1": 200.0}}},
                "ratios": {"share_of_copy_bandwidth": 0.9, "decode_over_hf_eager": 4.5},
                "per_decoded_token": {"cudaStreamSynchronize": 1.0, "cudaMemcpyAsync": 3.0, "cudaEventSynchronize": 1.0},
                "phases_done": ["decode", "count_syncs"],
                "cut_short": "--deadline 180 s had passed after phase 'count_syncs': the later figures were not taken"}
    engine32 = {"device": "NVIDIA H100 80GB HBM3",
                "results": {"llama_core": {"decode_tokens_per_s": 150.0, "aggregate_tokens_per_s": {"32": 2600.0}}},
                "ratios": {}}
    (tmp_path / "7b_compiled.json").write_text(json.dumps(compiled))
    (tmp_path / "7b_engine32.json").write_text(json.dumps(engine32))
    kernels = {"device": "NVIDIA H100 80GB HBM3", "forward_us": {"1:bf16": 5000.0, "1:int8_triton": 2800.0}}
    (tmp_path / "int8_kernels.json").write_text(json.dumps(kernels))  # bench_int8_cuda.py's, inductor's cut short
    (tmp_path / "device.log").write_text("name, memory.total [MiB], driver_version\n"
                                         "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04\n"
                                         "3.12.3 2.11.0+cu130 13.0 5.17.0 1.15.0 NVIDIA H100 80GB HBM3\n")
    (tmp_path / "tests_cuda.log").write_text("tests/test_cuda.py::test_a PASSED\n"
                                             "========= 1 failed, 15 passed in 95.20s (0:01:35) =========\n")
    result = _run("gpu_summary.py", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "device: NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04\n" in result.stdout
    assert "device: 3.12.3 2.11.0+cu130 13.0 5.17.0 1.15.0" in result.stdout
    assert "tests_cuda: 1 failed, 15 passed in 95.20s (0:01:35)\n" in result.stdout
    table = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in result.stdout.splitlines()
             if line.startswith("| ") and "---" not in line}
    assert table["batch-1 compiled decode >= 85 % of copy bandwidth"] == ["90.0%", "7b_compiled", "yes |"]
    assert table[">= 5x HF eager at batch 1 (compiled)"] == ["4.50x", "7b_compiled", "**no** |"]
    assert table["engine, 32 sequences >= 12x its batch-1 decode"][0] == "13.0x"  # over 7b_compiled's 200
    assert table["one sequence in the 32-slot engine >= 0.9x the one-slot engine's decode"] == [
        "0.75x", "7b_engine32 / 7b_compiled", "**no** |"]  # 150 against 200
    assert "uncompiled decode at batch 1, the app's default (reported)" not in table  # an optional step not run
    assert table["no host synchronisation per decoded token (compiled)"][0] == "1.00 waits per token"
    assert table["waits on the step before, the next one queued (reported)"][0] == "1.00 per token"
    assert table["int8 >= 1.7x bf16 compiled decode"][0] == "not measured"
    assert table["time to first token, 2048-token prompt, no slower than HF eager"][0] == "not measured"
    assert "7b_compiled was cut short: --deadline 180 s had passed" in result.stdout
    assert table["a 7B forward's products at one row, int8_triton over bf16 (reported)"] == [
        "1.79x", "int8_kernels", "yes |"]
    assert table["a 7B forward's products at one row, int8_inductor over bf16 (reported)"][0] == "not measured"


def test_gpu_summary_reads_a_report_cut_short_before_its_first_figure(tmp_path):
    # The H100's 7b_engine32 step (2026-11-27) was killed while it compiled: its report holds no implementation.
    empty = {"device": "NVIDIA H100 80GB HBM3", "results": {}, "ratios": {}, "phases_done": []}
    (tmp_path / "7b_engine32.json").write_text(json.dumps(empty))
    result = _run("gpu_summary.py", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "| engine, 32 sequences >= 12x its batch-1 decode | not measured |" in result.stdout


def test_load_bench_reports_memory_for_each_layout_and_load(tmp_path, tokenizer_path, tokenizer):
    report_path = tmp_path / "load.json"
    result = _run("bench_load.py", "--dim", "128", "--n-layers", "2", "--vocab-size", str(tokenizer.n_words),
                  "--tokenizer", str(tokenizer_path), "--loads", "float32,float32+int8", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(report_path.read_text())["rows"]
    assert [(r["checkpoint"], r["load"]) for r in rows] == [
        (layout, load) for layout in ("meta", "meta2", "hf") for load in ("float32", "float32+int8")]
    for row in rows:
        assert row["peak_anon"] >= row["anon_after"] > 0 and row["weights_bytes"] > 0 and row["seconds"] > 0
        assert f"{row['checkpoint']:<12} {row['load']:<14}" in result.stdout
    float32, int8 = rows[0], rows[1]
    assert int8["weights_bytes"] < float32["weights_bytes"] and int8["parameters"] == float32["parameters"]


def test_load_bench_names_a_bad_load():
    result = _run("bench_load.py", "--loads", "float32+int2")
    assert result.returncode == 2 and "--loads: 'float32+int2' is not a dtype" in result.stderr


def test_the_cuda_int8_kernel_bench_runs_through_as_a_dry_run_on_the_cpu(tmp_path):
    # bench_int8_cuda.py is for a device call: its dry run takes every variant once through Triton's
    # interpreter at 1/64 of the widths, and writes the report gpu_summary reads; the sweep's tilings and the
    # deadline run too.
    pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch bring it)")
    out = tmp_path / "int8_kernels.json"
    result = _run("bench_int8_cuda.py", "--dry-run", "--rows", "1", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    variants = {(r["projection"], r["rows"], r["variant"]) for r in report["results"]}
    for projection in ("wqkv", "wo", "w13", "w2", "output"):
        for rows in (1, 2):
            assert {(projection, rows, v) for v in ("bf16", "int8_dequant", "int8_triton", "int4_triton")} <= variants
    assert set(report["forward_us"]) == {f"{rows}:{v}" for rows in (1, 2)
                                         for v in ("bf16", "int8_dequant", "int8_triton", "int4_triton")}
    assert report["cut_short"] is False
    triton_rows = [r for r in report["results"] if r["variant"] == "int8_triton" and r["rows"] == 1]
    assert all(r["max_relative_error"] < 8e-3 for r in triton_rows)
    sweep = _run("bench_int8_cuda.py", "--dry-run", "--rows", "1", "--projections", "wo", "--sweep", "--out", str(out))
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    tilings = {r["variant"] for r in json.loads(out.read_text())["results"] if r["variant"].startswith("int8_triton[")}
    assert len(tilings) >= 24, tilings
    late = _run("bench_int8_cuda.py", "--dry-run", "--deadline", "0.001", "--out", str(out))
    assert late.returncode == 0 and "deadline" in json.loads(out.read_text())["cut_short"], late.stderr[-3000:]