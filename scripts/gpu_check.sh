#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("GPU"), for a machine with one CUDA GPU (torch, transformers and
# accelerate installed; gradio not needed): the 7B benchmarks against HF transformers and the CUDA tests.
# Each step has a time limit, and all the steps together a budget (GPU_CHECK_BUDGET_S, default 540 s: one
# call of a device tool that allows 600); a step the budget has no room for left is skipped, saying so, and
# the next one runs even if one fails. The benchmarks stop taking figures a while before their limit
# (bench.py --deadline) and write their JSON after every phase, so a step cut short still reports what it
# measured. Logs and JSON reports go to OUT_DIR: 10 files for the default steps.
#
#   bash scripts/gpu_check.sh --carry                 # here, beside ../shared: copies the files the CUDA tests
#                                                     # read from ../shared into .gpu-shared/ (git ignores it),
#                                                     # and llguidance as installed here (.gpu-shared/site)
#   bash scripts/gpu_check.sh OUT_DIR [STEP ...]      # there: the named steps in order (default: ALL_STEPS)
#   bash scripts/gpu_check.sh --list                  # the steps, in their default order, then the optional ones
#   python scripts/gpu_summary.py OUT_DIR             # the targets, met or not, from the JSON reports
#
# Where .gpu-shared/ is present (carried along with the working tree), the tests read it instead of ../shared.
set -uo pipefail
cd "$(dirname "$0")/.."

# The order puts first the CUDA tests (the fixes since the last device run, checked before anything is timed),
# then what that run did not measure (docs/benchmarks.md, "GPU"); 7b_compiled's figures are in docs/gpu/h100,
# so it comes last. The first call's budget ends around int8_kernels: a second call takes the rest.
ALL_STEPS=(device tests_cuda 7b_engine32 int8_kernels 7b_int8 7b_compiled)
OPTIONAL_STEPS=(7b_eager tests 7b_hf_compiled load_7b 7b_int4)  # run only when named
# GPU_CHECK_BENCH replaces the benchmark's command and shape: the test suite runs the steps' exact options on a
# tiny shape on the CPU with it, so that they are known to work before a device runs them.
read -r -a bench <<< "${GPU_CHECK_BENCH:-python3 scripts/bench.py --shape 7b --device cuda}"

if [[ ${1:-} == --list ]]; then
  printf '%s\n' "${ALL_STEPS[@]}"
  printf '%s (optional)\n' "${OPTIONAL_STEPS[@]}"
  exit 0
fi
if [[ ${1:-} == --carry ]]; then
  shared=${LLAMA_SHARED_DIR:-../shared}
  rm -rf .gpu-shared && mkdir -p .gpu-shared/models .gpu-shared/llama2 || exit 1
  cp -r "$shared/models/stories260K" .gpu-shared/models/ && cp "$shared/llama2/tokenizer.model" .gpu-shared/llama2/ || exit 1
  # llguidance (grammars) as installed here, for the device's PYTHONPATH: the device has no network to install it.
  python3 - <<'PY' || echo "llguidance is not installed here: the device's grammar tests will skip"
import importlib.metadata, pathlib, shutil
found = importlib.metadata.distribution("llguidance")
for file in found.files:
    source, target = pathlib.Path(found.locate_file(file)), pathlib.Path(".gpu-shared/site") / file
    if source.is_file() and not file.parts[0].endswith(".."):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
PY
  du -sh .gpu-shared
  exit 0
fi

out=${1:-${OUT:-gpu-results}}
shift $(( $# > 0 ? 1 : 0 ))
steps=("$@")
(( ${#steps[@]} )) || steps=("${ALL_STEPS[@]}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
[[ -d .gpu-shared ]] && export LLAMA_SHARED_DIR=$PWD/.gpu-shared
[[ -d .gpu-shared/site ]] && export PYTHONPATH=$PWD/.gpu-shared/site${PYTHONPATH:+:$PYTHONPATH}

budget=${GPU_CHECK_BUDGET_S:-540}
SECONDS=0

limit() {  # limit CAP: the seconds a step may take, CAP or what is left of the budget; 0 if under a minute
  local left=$(( budget - SECONDS ))
  (( left < 60 )) && { echo 0; return; }
  echo $(( $1 < left ? $1 : left ))
}

run() {  # run NAME SECONDS COMMAND...: runs COMMAND, its output to the screen and to OUT_DIR/NAME.log
  local name=$1 seconds=$2
  shift 2
  if (( seconds == 0 )); then
    echo "== $name: skipped, $(( budget - SECONDS )) s of the ${budget} s budget left"
    return
  fi
  echo "== $name (at most ${seconds} s): $*"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $SECONDS s of the ${budget} s budget"
}

run_bench() {  # run_bench NAME CAP ARGS...: bench.py on the 7B shape, taking figures until 3/4 of its time
  local name=$1 seconds
  seconds=$(limit "$2")
  shift 2
  run "$name" "$seconds" "${bench[@]}" "$@" --deadline $(( seconds * 3 / 4 )) --json "$out/$name.json"
}

for step in "${steps[@]}"; do
  case $step in
    device) run device 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
--format=csv; python3 -c 'import sys, torch, transformers, accelerate; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, transformers.__version__, accelerate.__version__, torch.cuda.get_device_name())'" ;;
    # The CUDA-graph decode step at batch 1 beside HF eager (targets: >= 85 % of the copy bandwidth measured
    # in the same run, >= 5x HF eager), what its decode loop does per token that makes the host wait, the
    # time to first token (no slower than HF eager) and greedy agreement with HF bf16 over 256 tokens.
    7b_compiled) run_bench 7b_compiled 240 --compile --prompt-lengths 128,512,2048 --batch-sizes 1 \
                   --decode-tokens 128 --repeats 3 --count-syncs --agreement-tokens 256 ;;
    # int8 weight-only beside bf16, both compiled at batch 1 (target: >= 1.7x), and int8's largest logprob
    # deviation; --count-syncs prints the int8 step's kernels by GPU time (on the H100 it read 51 % of the
    # copy bandwidth against bf16's 85 %: the table says which product kernels fall short).
    7b_int8) run_bench 7b_int8 180 --compile --quantize int8 --with-float --skip-hf --prompt-lengths 128 \
               --batch-sizes 1 --decode-tokens 128 --repeats 3 --count-syncs ;;
    # int8 products per projection of the 7B: llama_core.triton_products' kernel against bf16 (cuBLAS), the
    # dequantized product and inductor's fused one (what ran before the kernel), at 1, 8 and 32 rows; then
    # the kernel's one-row tilings until the deadline.
    int8_kernels) run int8_kernels "$(limit 120)" python3 scripts/bench_int8_cuda.py --sweep --deadline 80 \
                    --out "$out/int8_kernels.json" ;;
    # Optional. The decode step uncompiled (the app's default, without --compile) at batch 1 and 8: what
    # --compile gives a GPU user, beside 7b_compiled's figures.
    7b_eager) run_bench 7b_eager 120 --skip-hf --prompt-lengths 128 --batch-sizes 8 --decode-tokens 64 --repeats 2 ;;
    # Optional. int4 beside bf16 the same way (reported: its speed-up and largest logprob deviation).
    7b_int4) run_bench 7b_int4 180 --compile --quantize int4 --with-float --skip-hf --prompt-lengths 128 \
               --batch-sizes 1 --decode-tokens 128 --repeats 3 ;;
    # The engine with 32 sequences under the compiled step (target: >= 12x 7b_compiled's batch-1 decode), and
    # one sequence in that 32-slot engine (its static step compiled for one row and for many: two compiles,
    # each 60-90 s for the 7B on the H100, before the first figure; the figures then take about 30 s, so the
    # deadline, 3/4 of the limit, must fall after both compiles). Then 8 sequences, the app's default batch
    # (after 32, so that a deadline reached there costs the lesser figure).
    7b_engine32) run_bench 7b_engine32 300 --compile --skip-hf --prompt-lengths 128 --batch-sizes 32,8 \
                   --decode-tokens 64 --repeats 3 ;;
    # The CUDA tests, 4 at a time where pytest-xdist is installed (most of their time is compiling).
    tests_cuda) run tests_cuda "$(limit 170)" python3 -m pytest tests/test_cuda.py -v -rs -p no:cacheprovider \
                  $(python3 -c "import xdist" 2>/dev/null && echo "-n 4") ;;
    # Optional. The CPU tests of the decode steps, tensor parallel in one process and stories260K under the
    # device's Python and torch.
    tests) run tests "$(limit 480)" python3 -m pytest tests/test_parallel.py tests/test_decode.py \
             tests/test_stories260k.py -q -rs -p no:cacheprovider ;;
    # Optional. HF with its static cache under torch.compile, beside ours eager, at 1, 8 and 32 sequences.
    7b_hf_compiled) run_bench 7b_hf_compiled 500 --hf-compile --prompt-lengths 128 --batch-sizes 8,32 \
                      --decode-tokens 64 --repeats 2 ;;
    # Optional. Loading a 7B-shaped Hugging Face checkpoint (random, bfloat16; written first, 2 x 13.5 GB of
    # disk) in bfloat16 and as int8: load time, host memory and the GPU's peak (int8: the int8 model and one block).
    load_7b) run load_7b "$(limit 530)" python3 scripts/bench_load.py --device cuda --n-layers 32 --layouts hf \
               --loads bfloat16,bfloat16+int8 --tokenizer "${LLAMA_SHARED_DIR:-../shared}/llama2/tokenizer.model" \
               --json "$out/load_7b.json" ;;
    *) echo "unknown step: $step (steps: ${ALL_STEPS[*]} ${OPTIONAL_STEPS[*]})" >&2; exit 2 ;;
  esac
done
