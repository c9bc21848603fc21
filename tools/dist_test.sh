#!/usr/bin/env bash
# Multi-GPU testing with torchrun, mmdet's dist_test.sh conventions:
#   bash tools/dist_test.sh CONFIG CHECKPOINT GPUS [test.py options...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 PORT=29500 bash tools/dist_test.sh CONFIG CHECKPOINT 8 --out r.pkl
# Each rank gets its own device (LOCAL_RANK, set by torchrun); mmengine's launcher='pytorch' binds it.
set -euo pipefail

if [ "$#" -lt 3 ]; then
    echo "usage: $0 CONFIG CHECKPOINT GPUS [tools/test.py options, e.g. --work-dir DIR --out results.pkl" \
         "--cfg-options k=v]" >&2
    exit 2
fi

CONFIG=$1
CHECKPOINT=$2
GPUS=$3
shift 3
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}

# NVLink SHARP (NVLS) multicast and symmetric-memory multicast need fabric support that shared and virtualised
# hosts often lack; NCCL then fails at init or hangs. Plain NVLink/PCIe rings are what these jobs use anyway.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# One OpenMP thread per rank unless the user chose otherwise: GPUS ranks x all cores would oversubscribe the CPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHONPATH="$(dirname "$SCRIPT_DIR"):${PYTHONPATH:-}" \
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$GPUS" \
    --master_port="$PORT" \
    "$SCRIPT_DIR/test.py" \
    "$CONFIG" \
    "$CHECKPOINT" \
    --launcher pytorch "$@"
