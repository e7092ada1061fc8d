#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md in one go, for a machine with one CUDA GPU (torch, transformers and
# accelerate installed; gradio not needed): the CUDA tests, then the 7B benchmarks against HF transformers.
# Each step has a time limit and the next one runs even if it fails; logs and JSON reports go to OUT_DIR.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default: $OUT if set, else ./gpu-results
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: runs COMMAND, its output to the screen and to OUT_DIR/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}

step device 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
step versions 60 python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
step tests 600 python3 -m pytest tests/test_cuda.py tests/test_parallel.py tests/test_decode.py -q -p no:cacheprovider
# bf16 batch 1 against HF eager, with time to first token and 8-sequence throughput (target: >= 4x HF eager).
step 7b_eager 600 python3 scripts/bench.py --shape 7b --device cuda --prompt-lengths 128,512,2048 --batch-sizes 8 \
  --decode-tokens 64 --repeats 3 --json "$out/7b_eager.json"
# The CUDA-graph decode step (target: >= 80 % of the copy bandwidth measured in the same run).
step 7b_compiled 600 python3 scripts/bench.py --shape 7b --device cuda --compile --prompt-lengths 128 --batch-sizes 1 \
  --decode-tokens 128 --repeats 3 --json "$out/7b_compiled.json"
# int8 weight-only under the compiled step (target: >= 1.6x the compiled bf16 figure above).
step 7b_int8 600 python3 scripts/bench.py --shape 7b --device cuda --compile --quantize int8 --skip-hf \
  --prompt-lengths 128 --batch-sizes 1 --decode-tokens 128 --repeats 3 --json "$out/7b_int8.json"
# HF with its static cache under torch.compile, and 32 sequences.
step 7b_hf_compiled 600 python3 scripts/bench.py --shape 7b --device cuda --hf-compile --prompt-lengths 128 \
  --batch-sizes 8,32 --decode-tokens 64 --repeats 2 --json "$out/7b_hf_compiled.json"
