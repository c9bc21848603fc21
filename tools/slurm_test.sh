#!/usr/bin/env bash
# Testing on a slurm cluster, mmdet's slurm_test.sh conventions: srun starts one task per GPU, and mmengine's
# launcher='slurm' reads each task's rank, the world size and node 0's address from slurm's environment.
#   [GPUS=8] [GPUS_PER_NODE=8] [CPUS_PER_TASK=5] [SRUN_ARGS="..."] \
#       bash tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [tools/test.py options...]
#   GPUS=16 bash tools/slurm_test.sh dev ddetr configs/fast/CONFIG.py work_dirs/ddetr/iter_50000.pth --out r.pkl
# GPUS is the number of tasks in all, over nodes of GPUS_PER_NODE tasks (fewer where GPUS is smaller); SRUN_ARGS is
# split on white space and passed to srun before the command; MASTER_PORT (default 29500) must differ between jobs
# that share a node; PYTHON picks the interpreter.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$SCRIPT_DIR/launch_common.sh"

if [ "$#" -lt 4 ]; then
    echo "usage: [GPUS=8] [GPUS_PER_NODE=8] [CPUS_PER_TASK=5] [SRUN_ARGS=...] $0 PARTITION JOB_NAME CONFIG" \
         "CHECKPOINT [tools/test.py options, e.g. --work-dir DIR --out results.pkl --cfg-options k=v]" >&2
    exit 2
fi

PARTITION=$1
JOB_NAME=$2
CONFIG=$3
CHECKPOINT=$4
shift 4
check_slurm_variables
export_rank_environment

srun_python_tool "$PARTITION" "$JOB_NAME" test.py "$CONFIG" "$CHECKPOINT" --launcher=slurm "$@"
