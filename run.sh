#!/usr/bin/env bash
# torchrun wrapper for single- and multi-node runs; extra arguments go to train.py.
#   NPROC_PER_NODE=8 ./run.sh --config configs/llama2_7b.toml
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 ./run.sh --config configs/llama2_7b.toml   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 ./run.sh --config configs/llama2_7b.toml   # on node 1
#   NNODES=1:4 MASTER_ADDR=node0 ./run.sh ...   # elastic: 1 to 4 nodes, same command on each
# A crashed worker makes torchrun restart the whole group (up to MAX_RESTARTS times); the
# restarted workers resume from the newest complete checkpoint.
# PRINT_ONLY=1 prints the torchrun command (shell-quoted) instead of running it.
# The working directory stays the caller's: relative --config, --data-files and --output-dir
# paths mean what they mean where the command was typed.
set -euo pipefail
REPO="$(cd "$(dirname "$0")" && pwd)"

NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29400}"
RDZV_ID="${RDZV_ID:-default}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
# Seconds to wait for all nodes at a (re)start: long enough for a restarted node to come back.
RDZV_TIMEOUT="${RDZV_TIMEOUT:-900}"

# The workers keep each attempt's process groups under a key prefix of its own, so restarts
# reconnect with torchrun's shared store too. Elastic membership changes (NNODES=MIN:MAX) still
# need a store per rendezvous round: with the shared one, torch 2.15's agents time out in their
# own round after a node joins (tests/test_elastic.py), so run.sh asks for one.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

if command -v uv >/dev/null 2>&1; then
  TORCHRUN=(uv run --project "$REPO" torchrun)
else
  TORCHRUN=(torchrun)
fi

# NNODES=MIN:MAX is elastic: nodes may leave and join; the c10d rendezvous numbers them, so no
# --node_rank, and a restarted group resumes at the new world size (see docs/elastic.md).
NODE_RANK_ARG=(--node_rank="$NODE_RANK")
if [[ "$NNODES" == *:* ]]; then
  NODE_RANK_ARG=()
fi

COMMAND=(
  "${TORCHRUN[@]}"
  --nproc_per_node="$NPROC_PER_NODE"
  --nnodes="$NNODES"
  "${NODE_RANK_ARG[@]}"
  --rdzv_id="$RDZV_ID"
  --rdzv_backend=c10d
  --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"
  --rdzv_conf="join_timeout=$RDZV_TIMEOUT,last_call_timeout=30,close_timeout=60"
  --max_restarts="$MAX_RESTARTS"
  "$REPO/train.py" "$@"
)
if [ "${PRINT_ONLY:-0}" = 1 ]; then
  printf '%q ' "${COMMAND[@]}"
  printf '\n'
  exit 0
fi
exec "${COMMAND[@]}"
