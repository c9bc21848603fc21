# What tools/dist_train.sh, dist_test.sh, slurm_train.sh and slurm_test.sh share (sourced, never run): checks of the
# values users pass, each ending the script with one "error:" line that names the variable and its value, exit
# status 2 (as argparse ends the Python tools), and the environment every rank starts with.

launch_error() {
    echo "error: $*" >&2
    exit 2
}

# require_whole_number NAME VALUE MIN: VALUE is a whole number (digits only) >= MIN.
require_whole_number() {
    local name=$1 value=$2 min=$3
    if ! [[ $value =~ ^[0-9]+$ ]]; then
        launch_error "$name must be a whole number >= $min, got '$value'"
    fi
    # 10#: a leading zero must not make bash read the number as octal ("08" is an error there).
    if ((10#$value < min)); then
        launch_error "$name must be a whole number >= $min, got '$value'"
    fi
}

# check_torchrun_variables: NNODES, NODE_RANK, MASTER_ADDR and PORT (MASTER_PORT is taken as another name for PORT)
# as torchrun needs them; sets the four variables, defaults filled in as in mmdet's scripts.
check_torchrun_variables() {
    if [ -n "${PORT:-}" ] && [ -n "${MASTER_PORT:-}" ] && [ "$PORT" != "$MASTER_PORT" ]; then
        launch_error "PORT=$PORT and MASTER_PORT=$MASTER_PORT disagree: set one of them (the port of node 0's" \
                     "rendezvous)"
    fi
    NNODES=${NNODES:-1}
    NODE_RANK=${NODE_RANK:-0}
    PORT=${PORT:-${MASTER_PORT:-29500}}
    require_whole_number NNODES "$NNODES" 1
    require_whole_number NODE_RANK "$NODE_RANK" 0
    if ((10#$NODE_RANK >= 10#$NNODES)); then
        launch_error "NODE_RANK=$NODE_RANK is not below NNODES=$NNODES: the nodes are numbered 0 to $((10#$NNODES - 1))"
    fi
    require_whole_number PORT "$PORT" 1
    if ((10#$PORT > 65535)); then
        launch_error "PORT=$PORT is not a TCP port (1 to 65535)"
    fi
    if [ -z "${MASTER_ADDR:-}" ] && ((10#$NNODES > 1)); then
        # mmdet's default, kept: right when every node runs on this host, and otherwise the other nodes wait for a
        # rendezvous that never comes, so say so once.
        echo "warning: NNODES=$NNODES without MASTER_ADDR: every node looks for node 0 at 127.0.0.1, which only" \
             "works when all of them run on this host" >&2
    fi
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
    if [[ $MASTER_ADDR =~ [[:space:]] ]]; then
        launch_error "MASTER_ADDR='$MASTER_ADDR' is not a host name or address"
    fi
}

export_rank_environment() {
    # NVLink SHARP (NVLS) multicast and symmetric-memory multicast need fabric support that shared and virtualised
    # hosts often lack; NCCL then fails at init or hangs. Plain NVLink/PCIe rings are what these jobs use anyway.
    export NCCL_NVLS_ENABLE=0
    export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    # One OpenMP thread per rank unless the user chose otherwise: N ranks x all cores would oversubscribe the CPU.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
}

# check_slurm_variables: GPUS, GPUS_PER_NODE, CPUS_PER_TASK and SRUN_ARGS for srun, defaults as in mmdet's scripts;
# sets TASKS_PER_NODE (GPUS_PER_NODE, or GPUS where that is fewer: a job smaller than a node asks for the GPUs it
# uses) and SRUN_EXTRA_ARGS (SRUN_ARGS split on white space).
check_slurm_variables() {
    GPUS=${GPUS:-8}
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    CPUS_PER_TASK=${CPUS_PER_TASK:-5}
    require_whole_number GPUS "$GPUS" 1
    require_whole_number GPUS_PER_NODE "$GPUS_PER_NODE" 1
    require_whole_number CPUS_PER_TASK "$CPUS_PER_TASK" 1
    TASKS_PER_NODE=$((10#$GPUS < 10#$GPUS_PER_NODE ? 10#$GPUS : 10#$GPUS_PER_NODE))
    read -r -a SRUN_EXTRA_ARGS <<< "${SRUN_ARGS:-}"
    if ! command -v srun > /dev/null; then
        launch_error "srun is not on PATH: $(basename "$0") runs where slurm's commands are (a cluster's login node)"
    fi
}

# srun_python_tool PARTITION JOB_NAME TOOL ARGS...: tools/TOOL under srun, one task per GPU (check_slurm_variables
# first), the repository importable, mmengine's launcher reading the ranks from slurm.
srun_python_tool() {
    local partition=$1 job_name=$2 tool=$3
    shift 3
    PYTHONPATH="$(dirname "$SCRIPT_DIR"):${PYTHONPATH:-}" \
    exec srun -p "$partition" \
        --job-name="$job_name" \
        --gres=gpu:"$TASKS_PER_NODE" \
        --ntasks="$GPUS" \
        --ntasks-per-node="$TASKS_PER_NODE" \
        --cpus-per-task="$CPUS_PER_TASK" \
        --kill-on-bad-exit=1 \
        "${SRUN_EXTRA_ARGS[@]}" \
        "${PYTHON:-python3}" -u "$SCRIPT_DIR/$tool" "$@"
}
