#!/usr/bin/env bash
# Checkpoints written by an older commit, resumed by this checkout: one run per method and mode,
# 2 gloo ranks. Each combination: the old code trains 6 steps (checkpoint at step 4); this code
# resumes step 4 and trains to 6; the losses of steps 5 and 6 and the final weights must equal the
# old code's uninterrupted run. Prints a Markdown table.
#
#   git worktree add --detach /tmp/old 6de1f9a
#   bash benchmarks/old_checkpoints.sh /tmp/old        # OUT=/tmp/compat by default
set -u
NEW=$(cd "$(dirname "$0")/.." && pwd)
OLD=$(cd "${1:?usage: old_checkpoints.sh OLD_CHECKOUT}" && pwd)
OUT=${OUT:-/tmp/compat}
TORCHRUN=$NEW/.venv/bin/torchrun
rm -rf "$OUT"; mkdir -p "$OUT"
common() {
  echo --config $NEW/configs/tiny.toml --tokenizer $NEW/configs/llama-8m \
    --data-files "$NEW/data/c4/*train*.json.gz" --eval-files "$NEW/data/c4/*validation*.json.gz" \
    --model $NEW/configs/tiny-models/llama-v4096/config.json --seq-length 16 --batch-size 2 \
    --accumulation-steps 2 --warmup-steps 2 --log-every 1 --eval-every 0 --eval-batches 1 \
    --learning-rate 3e-3 --max-steps 6 --checkpoint-every 4
}
declare -A COMBOS=(
  [ddp-adamw]="--data-parallel ddp --optimizer adamw"
  [ddp-adamw-dct]="--data-parallel ddp --optimizer adamw --compression dct"
  [ddp-demo]="--data-parallel ddp --optimizer demo --zero1 false"
  [ddp-diloco]="--data-parallel ddp --optimizer diloco --local-steps 3 --zero1 false"
  [ddp-sparseloco]="--data-parallel ddp --optimizer sparseloco --local-steps 3 --zero1 false"
  [fsdp-adamw]="--data-parallel fsdp --optimizer adamw --zero1 false --compression none"
  [hsdp-adamw-dct]="--data-parallel hsdp --shard-degree 1 --optimizer adamw --zero1 false --compression dct"
  [hsdp-demo]="--data-parallel hsdp --shard-degree 1 --optimizer demo --zero1 false"
  [hsdp-diloco]="--data-parallel hsdp --shard-degree 1 --optimizer diloco --local-steps 3 --zero1 false"
  [hsdp-sparseloco]="--data-parallel hsdp --shard-degree 1 --optimizer sparseloco --local-steps 3 --zero1 false"
)
printf '| run | old loss 5, 6 | resumed here, loss 5, 6 | final weights |\n|---|---|---|---|\n'
for name in $(printf '%s\n' "${!COMBOS[@]}" | sort); do
  flags=${COMBOS[$name]}
  (cd "$OLD" && PYTHONPATH=$OLD/src $TORCHRUN --nproc-per-node 2 train.py $(common) $flags \
     --output-dir "$OUT/$name/old" >"$OUT/$name.old.log" 2>&1)
  (cd "$NEW" && $TORCHRUN --nproc-per-node 2 train.py $(common) $flags --output-dir "$OUT/$name/new" \
     --resume-from "$OUT/$name/old/checkpoints/step-4" >"$OUT/$name.new.log" 2>&1)
  $NEW/.venv/bin/python - "$OUT/$name" "$name" <<'PY'
import json, sys
from pathlib import Path
from safetensors.torch import load_file
import torch
root, name = Path(sys.argv[1]), sys.argv[2]
def losses(run):
    path = root / run / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
old, new = losses("old"), losses("new")
o = [old.get(s) for s in (5, 6)]; n = [new.get(s) for s in (5, 6)]
try:
    a = load_file(root / "old/final_model/model.safetensors"); b = load_file(root / "new/final_model/model.safetensors")
    same = "bit-identical" if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) else "DIFFER"
except Exception as exc:
    same = f"missing ({type(exc).__name__})"
print(f"| {name} | {o} | {n} | {same} |")
PY
done
