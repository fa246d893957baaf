#!/usr/bin/env bash
# A rank that is gone without closing its connections: how long until the other notices?
# Trains the bundled tiny config on 2 gloo ranks with --train-timeout-s T (default 20; start-up
# keeps --timeout-s 600), freezes rank 1 with SIGSTOP after step 5 (its sockets stay open, as
# after a power loss or a cut link), and prints the seconds until rank 0's collective fails and
# torchrun exits, and the error line. Expect rank 0 to fail after about T seconds.
# Usage: bash benchmarks/silent_peer.sh [T]
set -euo pipefail
cd "$(dirname "$0")/.."
timeout_s="${1:-20}"
out="$(mktemp -d)"
trap 'pkill -KILL -f -- "--output-dir $out/run" 2>/dev/null || true; rm -rf "$out"' EXIT
uv run torchrun --nproc_per_node 2 train.py --config configs/tiny.toml \
  --model configs/tiny-models/llama/config.json --output-dir "$out/run" --seq-length 32 \
  --batch-size 2 --max-steps 100000 --checkpoint-every 0 --eval-every 0 --log-every 1 \
  --threads 1 --timeout-s 600 --train-timeout-s "$timeout_s" >"$out/log" 2>&1 &
launcher=$!
until grep -q "step 5 |" "$out/log"; do sleep 0.5; done
for pid in $(pgrep -f -- "train.py .*--output-dir $out/run"); do
  if tr '\0' '\n' <"/proc/$pid/environ" | grep -qx "RANK=1"; then kill -STOP "$pid"; fi
done
SECONDS=0
until grep -q "Timed out waiting" "$out/log" || ! kill -0 "$launcher" 2>/dev/null; do sleep 0.5; done
failed_after=$SECONDS
status=0
wait "$launcher" || status=$?
echo "rank 0 failed ${failed_after} s after rank 1 stopped (--train-timeout-s $timeout_s); torchrun" \
  "exited with status $status after ${SECONDS} s (it waits before it SIGKILLs the stopped rank)"
grep -m1 -o "Timed out waiting [0-9]*ms for [a-z]* operation" "$out/log" || echo "no collective timeout in the log"
