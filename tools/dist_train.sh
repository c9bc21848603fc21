#!/usr/bin/env bash
# Multi-GPU and multi-node training with torchrun, mmdet's dist_train.sh conventions:
#   bash tools/dist_train.sh CONFIG GPUS [tools/train.py options...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 PORT=29500 bash tools/dist_train.sh CONFIG 8 --amp   (on node 0)
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 PORT=29500 bash tools/dist_train.sh CONFIG 8 --amp   (on node 1)
# GPUS is the number of ranks on this node. Each rank gets its own device (LOCAL_RANK, set by torchrun), which
# mmengine's launcher='pytorch' binds; on a machine without CUDA devices the ranks run on the CPU over gloo.
# MASTER_PORT is taken as another name for PORT; PYTHON picks the interpreter.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$SCRIPT_DIR/launch_common.sh"

if [ "$#" -lt 2 ]; then
    echo "usage: $0 CONFIG GPUS [tools/train.py options, e.g. --work-dir DIR --amp --cfg-options k=v]" >&2
    exit 2
fi

CONFIG=$1
GPUS=$2
shift 2
require_whole_number GPUS "$GPUS" 1
check_torchrun_variables
export_rank_environment

PYTHONPATH="$(dirname "$SCRIPT_DIR"):${PYTHONPATH:-}" \
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$GPUS" \
    --master_port="$PORT" \
    "$SCRIPT_DIR/train.py" \
    "$CONFIG" \
    --launcher pytorch "$@"
