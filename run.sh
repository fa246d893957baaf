#!/usr/bin/env bash
# torchrun wrapper for single- and multi-node runs. Extra arguments go to train.py.
#   NPROC_PER_NODE=8 ./run.sh --config configs/llama2_7b.toml
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 ./run.sh --config configs/llama2_7b.toml   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 ./run.sh --config configs/llama2_7b.toml   # on node 1
set -euo pipefail
cd "$(dirname "$0")"

NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29400}"
RDZV_ID="${RDZV_ID:-default}"

if command -v uv >/dev/null 2>&1; then
  TORCHRUN=(uv run torchrun)
else
  TORCHRUN=(torchrun)
fi

exec "${TORCHRUN[@]}" \
  --nproc_per_node="$NPROC_PER_NODE" \
  --nnodes="$NNODES" \
  --node_rank="$NODE_RANK" \
  --rdzv_id="$RDZV_ID" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
  train.py "$@"
