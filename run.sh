#!/usr/bin/env bash
# torchrun wrapper for single- and multi-node runs; extra arguments go to train.py.
#   NPROC_PER_NODE=8 ./run.sh --config configs/llama2_7b.toml
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 ./run.sh --config configs/llama2_7b.toml   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 ./run.sh --config configs/llama2_7b.toml   # on node 1
#   NNODES=1:4 MASTER_ADDR=node0 ./run.sh ...   # elastic: 1 to 4 nodes, same command on each
# A crashed worker makes torchrun restart the whole group (up to MAX_RESTARTS times); the
# restarted workers resume from the newest complete checkpoint.
# PRINT_ONLY=1 prints the torchrun command (shell-quoted) instead of running it.
# --fault-tolerance sites (docs/fault-tolerance.md#fault-tolerant-sites): each site runs run.sh
# as its own job; LIGHTHOUSE=1 also starts the torchft lighthouse on this host (in the
# background, stopped when torchrun exits), `./run.sh lighthouse` runs only the lighthouse.
#   LIGHTHOUSE_BIND ([::]:29510), LIGHTHOUSE_MIN_SITES (1), LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS
#   (5000: a site silent that long is dead), LIGHTHOUSE_JOIN_TIMEOUT_MS (60000: how long a
#   quorum waits for a site that heartbeats but has not asked for it, one that is starting).
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
  LIGHTHOUSE_BIN=(uv run --project "$REPO" torchft_lighthouse)
else
  TORCHRUN=(torchrun)
  LIGHTHOUSE_BIN=(torchft_lighthouse)
fi
LIGHTHOUSE_COMMAND=(
  "${LIGHTHOUSE_BIN[@]}"
  --bind "${LIGHTHOUSE_BIND:-[::]:29510}"
  --min_replicas "${LIGHTHOUSE_MIN_SITES:-1}"
  --heartbeat_timeout_ms "${LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS:-5000}"
  --join_timeout_ms "${LIGHTHOUSE_JOIN_TIMEOUT_MS:-60000}"
)
if [ "${1:-}" = lighthouse ]; then
  if [ "${PRINT_ONLY:-0}" = 1 ]; then
    printf '%q ' "${LIGHTHOUSE_COMMAND[@]}"
    printf '\n'
    exit 0
  fi
  exec "${LIGHTHOUSE_COMMAND[@]}"
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
  if [ "${LIGHTHOUSE:-0}" = 1 ]; then
    printf '%q ' "${LIGHTHOUSE_COMMAND[@]}"
    printf '&\n'
  fi
  printf '%q ' "${COMMAND[@]}"
  printf '\n'
  exit 0
fi
if [ "${LIGHTHOUSE:-0}" = 1 ]; then
  "${LIGHTHOUSE_COMMAND[@]}" &
  LIGHTHOUSE_PID=$!
  trap 'kill "$LIGHTHOUSE_PID" 2>/dev/null || true' EXIT
  "${COMMAND[@]}"
  exit $?
fi
exec "${COMMAND[@]}"
