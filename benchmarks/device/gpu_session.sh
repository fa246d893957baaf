#!/usr/bin/env bash
# One call on a lent GPU machine (docs/benchmarks.md#gpu): the 1.1B LLaMA's throughput under
# DDP and FSDP2, eager and compiled, with and without the fused loss and at the largest
# micro-batch the plan allows; the first LLaMA-2-7B steps (LoRA, and full fine-tuning under FSDP2
# on one rank); then the GPU tests. Run from the repository root:
#
#   bash benchmarks/device/gpu_session.sh [phase ...]     # default: every phase, in this order
#   CPU_CHECK=1 PYTHON=/path/to/python3.12 bash benchmarks/device/gpu_session.sh   # on a CPU
#
# Phases: eager, seven_b, compiled, tests, ddp_compiled. Each writes $OUT/<phase>.log (OUT
# defaults to /tmp/gpu-session) under a time limit of its own, so a slow phase costs the ones
# after it nothing but its limit. The device image's torch (2.11) is older than the pinned one:
# the packages this project needs at its pinned versions come as wheels in .whl/ (made by
# benchmarks/device/wheels.sh), installed into /tmp/site, and benchmarks/device/sitecustomize.py
# maps the two torch calls that 2.11 names differently. CPU_CHECK=1 runs every phase on the CPU
# with the tiny LLaMA, a few steps each, to check the script before it costs device time.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-session}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD/benchmarks/device:/tmp/site:$PWD/src" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if [[ "${CPU_CHECK:-0}" == 1 ]]; then
  ONE_B=(--device cpu --model configs/tiny-models/llama/config.json --seq-length 64 --batch-size 2
         --steps 3 --warmup 1 --epochs 2)
  BIG=mb4
  SEVEN_B=(--device cpu --model configs/tiny-models/llama/config.json --steps 3
           --lora-seq-length 128 --fsdp-seq-length 128)
  PRECISION=fp32
  LOSS=plain  # Liger's kernels need CUDA: the check runs the plain loss where the GPU runs liger
else
  ONE_B=(--device cuda --model configs/llama-1b/config.json --seq-length 2048 --batch-size 8
         --steps 20 --warmup 8 --epochs 8)
  BIG=mb32  # FSDP2 + fused loss: 132.4 GiB planned (the plan's largest on an H200 is 34)
  SEVEN_B=(--steps 6 --fsdp-batch 4 --fsdp-seq-length 2048)
  PRECISION=bf16
  LOSS=liger
fi
P=1x1-$PRECISION

phase() {  # phase NAME SECONDS COMMAND...: run COMMAND under a limit, output to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%T), limit ${limit} s)"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -E \
      '^\||^[a-z0-9x-]+: |FAILED|Error|error:|passed|failed|skipped' | cut -c1-400
  echo "=== $name ended with status ${PIPESTATUS[0]} ($(date -u +%T))"
}

TP=("$PYTHON" benchmarks/throughput.py "${ONE_B[@]}" --data-dir data --skip-failed)

run_phase() {
  case $1 in
    eager) phase eager 120 "${TP[@]}" --timeout-s 60 --settings "$P-plain,$P-$LOSS,$P-fsdp-$LOSS" ;;
    seven_b) phase seven_b 150 "$PYTHON" benchmarks/first_steps.py "${SEVEN_B[@]}" \
        --timeout-s 90 ;;
    compiled) phase compiled 170 "${TP[@]}" --timeout-s 100 \
        --settings "$P-fsdp-compile-$LOSS,$P-fsdp-compile-$LOSS-$BIG" ;;
    tests) phase tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_gpu.py tests/test_hot_loop.py ;;
    ddp_compiled) phase ddp_compiled 120 "${TP[@]}" --timeout-s 110 --settings "$P-compile-$LOSS" ;;
    *) echo "unknown phase $1" && return 1 ;;
  esac
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PYTHON" -c 'import sys, torch, transformers, peft, liger_kernel, triton
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "peft", peft.__version__, "triton",
      triton.__version__)'
} 2>&1 | tee "$OUT/setup.log"
PHASES=("$@")
[[ ${#PHASES[@]} -eq 0 ]] && PHASES=(eager seven_b compiled tests ddp_compiled)
for name in "${PHASES[@]}"; do
  run_phase "$name"
done
