#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("GPU"), for a machine with one CUDA GPU (torch, transformers and
# accelerate installed; gradio not needed): the CUDA tests, then the 7B benchmarks against HF transformers.
# Each step has a time limit and the next one runs even if it fails; logs and JSON reports go to OUT_DIR.
#
#   bash scripts/gpu_check.sh --carry                 # here, beside ../shared: copies the files the CUDA tests
#                                                     # read from ../shared into .gpu-shared/ (git ignores it)
#   bash scripts/gpu_check.sh OUT_DIR [STEP ...]      # there: the named steps in order (default: all)
#   bash scripts/gpu_check.sh --list                  # the steps, in their default order
#   python scripts/gpu_summary.py OUT_DIR             # the targets, met or not, from the JSON reports
#
# Where .gpu-shared/ is present (carried along with the working tree), the tests read it instead of ../shared.
# Every step ends well inside 9 minutes, so any one step fits one call to a machine that allows 10.
set -uo pipefail
cd "$(dirname "$0")/.."

ALL_STEPS=(device versions tests_cuda tests 7b_compiled 7b_eager 7b_int8 7b_engine32 7b_hf_compiled)
OPTIONAL_STEPS=(load_7b)  # run only when named
bench=(python3 scripts/bench.py --shape 7b --device cuda)

if [[ ${1:-} == --list ]]; then
  printf '%s\n' "${ALL_STEPS[@]}"
  printf '%s (optional)\n' "${OPTIONAL_STEPS[@]}"
  exit 0
fi
if [[ ${1:-} == --carry ]]; then
  shared=${LLAMA_SHARED_DIR:-../shared}
  rm -rf .gpu-shared && mkdir -p .gpu-shared/models .gpu-shared/llama2 || exit 1
  cp -r "$shared/models/stories260K" .gpu-shared/models/ && cp "$shared/llama2/tokenizer.model" .gpu-shared/llama2/ || exit 1
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

run() {  # run NAME SECONDS COMMAND...: runs COMMAND, its output to the screen and to OUT_DIR/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}

for step in "${steps[@]}"; do
  case $step in
    device) run device 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv ;;
    versions) run versions 60 python3 -c "import sys, torch, transformers, accelerate; print(sys.version.split()[0], \
torch.__version__, torch.version.cuda, transformers.__version__, accelerate.__version__, torch.cuda.get_device_name())" ;;
    # The CUDA tests (several compile a tiny model's step), then the decode steps (eager, static, compiled),
    # tensor parallel in one process and stories260K, which run on the CPU too.
    tests_cuda) run tests_cuda 480 python3 -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider ;;
    tests) run tests 480 python3 -m pytest tests/test_parallel.py tests/test_decode.py tests/test_stories260k.py \
             -q -rs -p no:cacheprovider ;;
    # The CUDA-graph decode step beside HF eager (targets: >= 85 % of the copy bandwidth measured in the
    # same run, >= 5x HF eager), and what its decode loop does per token that makes the host wait.
    7b_compiled) run 7b_compiled 480 "${bench[@]}" --compile --prompt-lengths 128 --batch-sizes 1 \
                   --decode-tokens 128 --repeats 3 --count-syncs --json "$out/7b_compiled.json" ;;
    # Eager bf16 beside HF eager: time to first token (target: no slower), 8 sequences, and greedy agreement
    # with HF bf16 over 256 tokens.
    7b_eager) run 7b_eager 420 "${bench[@]}" --prompt-lengths 128,512,2048 --batch-sizes 8 --decode-tokens 64 \
                --repeats 3 --agreement-tokens 256 --json "$out/7b_eager.json" ;;
    # int8 weight-only beside bf16, both compiled (target: >= 1.7x), and int8's largest logprob deviation.
    7b_int8) run 7b_int8 530 "${bench[@]}" --compile --quantize int8 --with-float --skip-hf --prompt-lengths 128 \
               --batch-sizes 1 --decode-tokens 128 --repeats 3 --json "$out/7b_int8.json" ;;
    # The engine with 32 sequences under the compiled step (target: >= 12x the batch-1 decode of 7b_compiled).
    7b_engine32) run 7b_engine32 480 "${bench[@]}" --compile --skip-hf --prompt-lengths 128 --batch-sizes 32 \
                   --decode-tokens 64 --repeats 3 --json "$out/7b_engine32.json" ;;
    # HF with its static cache under torch.compile, beside ours eager, at 1, 8 and 32 sequences.
    7b_hf_compiled) run 7b_hf_compiled 500 "${bench[@]}" --hf-compile --prompt-lengths 128 --batch-sizes 8,32 \
                      --decode-tokens 64 --repeats 2 --json "$out/7b_hf_compiled.json" ;;
    # Loading a 7B-shaped Hugging Face checkpoint (random, bfloat16; written first, 2 x 13.5 GB of disk) in
    # bfloat16 and as int8: load time, host memory and the GPU's peak (int8: the int8 model and one block).
    load_7b) run load_7b 530 python3 scripts/bench_load.py --device cuda --n-layers 32 --layouts hf \
               --loads bfloat16,bfloat16+int8 --tokenizer "${LLAMA_SHARED_DIR:-../shared}/llama2/tokenizer.model" \
               --json "$out/load_7b.json" ;;
    *) echo "unknown step: $step (steps: ${ALL_STEPS[*]} ${OPTIONAL_STEPS[*]})" >&2; exit 2 ;;
  esac
done
