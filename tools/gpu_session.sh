#!/usr/bin/env bash
# The GPU checks and measurements of a release, on a fresh host without registry access (one or two GPUs).
#
#   bash tools/gpu_session.sh wheelhouse          (here, with registry access: fills .whl, which the host needs)
#   bash tools/gpu_session.sh PHASE [OUT]         (on the GPU host, from the repository root)
#
# PHASE:
#   wheelhouse  not on the GPU host: the wheels (CPython 3.12, manylinux x86_64) of mmengine, mmdet, mmcv-lite and
#             their small dependencies (panopticapi-lite: the panoptic configs' data loading), and mmcv's source
#             (for the stock baseline's build), into .whl (or OUT);
#             the host has Python 3.12, torch, triton, numpy, scipy and opencv, and no way to download the rest.
#   tests     mmcv's CUDA ops start building in the background (the stock baseline, into the system site); the GPU
#             tests run meanwhile on mmcv-lite; then (after the tests, on a one-GPU host) the MSDA entry benchmark
#             runs against the stock op. TEST_PATHS picks the test files, ENTRY_BENCH=0 skips the benchmark.
#   train     the training benchmark through mmengine's Runner (tools/benchmark_train.py), stock vs ours in the
#             three regimes (with ShapeBucketsHook, without it, from an empty Triton cache; the other rows after
#             `python -m deform_plugin warmup`, timed), then batch-1 inference on mixed real image sizes
#             (tools/benchmark_infer.py). With two GPUs, two configs run at once, one per GPU.
#   scale     two-GPU DDP against one GPU (SCALE_ITERS iterations, default 100; SCALE_CONFIGS picks the configs,
#             default ddetr), the demo's loss curves (plain fp32 vs fast bf16; DEMO=0 skips them) and (unless
#             PROFILE=0) a step profile.
#   borrow    ShapeBucketsHook's borrowed shapes: each BORROW_CONFIGS config (default ddetr dino) as shipped against
#             the same config with BORROW_SETTINGS (default "1,1.5": no borrowing; "UNTIL,MAX_PIXELS" pairs), one
#             GPU, rows one after another (BORROW_ITERS iterations, default 150); compare iterations 2-100 in the
#             report's per-iteration times (iteration 1 of a call's first row compiles the Triton kernels).
#   profile   the step profile alone (stock fp32, ours bf16 without and with the config's fast paths).
#   ops       the op tables of README and docs/kernels.md, stock timed in each run: the MSDA entries (uniform, then
#             realistic locations), the host split of a decoder-sized call, the deterministic backward, and
#             deformable SDPA at the seed's size in fp32 and bf16.
#   build     mmcv's CUDA ops only (the stock baseline), for the phases after it on the same host; with PACK=1 the
#             build comes back packed in OUT: copied into .whl, later fresh hosts unpack it in seconds.
#   sizes     training steps at new and at seen random-resize sizes (tools/benchmark.py --variable-sizes).
#   memory    the FFN memory switches (relu_dropout_fusion, ffn_recompute) against the same fast step without them:
#             peak memory and step time of Deformable-DETR and DINO at 800x1333 (tools/benchmark.py), stock beside.
#   parity    AP parity over seeds (tools/ap_parity.py): stock fp32 against the fast configs in fp32 and bf16 (and bf16
#             without ShapeBucketsHook), Deformable-DETR and DINO, 3 seeds, every run at once over the host's GPUs,
#             ending before the phase's deadline; the report (md, json, csv, one PNG per config) goes straight to
#             OUT. PARITY_ROWS, PARITY_ITERS (default auto: as many as fit) and PARITY_ARGS adjust it.
#   multinode tools/dist_train.sh as two nodes on this host, one GPU each over NCCL (tests/tools/test_two_nodes.py,
#             its cuda-nccl variant; two GPUs), and its CPU variant over gloo.
# Every phase but wheelhouse needs .whl, made by the wheelhouse phase and copied to the host with the tree. Results
# go to OUT (default $OUT, else bench_results/gpu): one log per job and a tarball of every result file.
set -uo pipefail
phase=${1:?usage: bash tools/gpu_session.sh wheelhouse|tests|train|ops|scale|borrow|profile|build|sizes|memory|parity|multinode [OUT]}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

make_wheelhouse() {  # DEST: everything install_wheels and build_mmcv read on the host
  local dest=$1 platforms=() tmp
  set -e
  mkdir -p "$dest/src"
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
      manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$dest" mmengine==0.10.7 mmdet==3.3.0 mmcv-lite==2.1.0 addict yapf platformdirs termcolor \
      terminaltables pycocotools shapely panopticapi-lite==0.2.0
  # mmcv's source distribution: preparing its metadata imports pkg_resources, which setuptools 82 removed, so a
  # throwaway environment with an older setuptools fetches it.
  tmp=$(mktemp -d)
  python3 -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install -q "setuptools<82" wheel
  "$tmp/venv/bin/pip" download -q --no-deps --no-build-isolation -d "$dest/src" mmcv==2.1.0
  rm -rf "$tmp"
  ls -1 "$dest" "$dest/src"
  du -sh "$dest"
}

if [ "$phase" = wheelhouse ]; then
  make_wheelhouse "${2:-.whl}"
  exit
fi
out=${2:-${OUT:-bench_results/gpu}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
results="$repo/bench_results/gpu-$phase"
mkdir -p "$results"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export DEFORM_PLUGIN_COMMIT=${DEFORM_PLUGIN_COMMIT:-unknown}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
lite=/tmp/site_lite   # mmcv-lite: deform_plugin's stand-in serves MSDA, focal loss and NMS
full=/tmp/site_full   # mmcv built from source: stock mmdet + mmcv, the baseline
build_log=/tmp/mmcv_build.log

prebuilt=.whl/mmcv-2.1.0-sm90-built.tar.xz  # split in parts of under 16 MiB (what a device call brings back)

install_wheels() {
  [ -d "$lite" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$lite" .whl/*.whl
  [ -d "$full" ] || ls .whl/*.whl | grep -v mmcv_lite \
    | xargs python3 -m pip install -q --no-index --no-deps --no-compile --target "$full"
  # A build packed by an earlier session (pack_mmcv) on the same torch: seconds instead of the 4-13 min build.
  if ls "$prebuilt".part-* > /dev/null 2>&1 && [ ! -f /tmp/mmcv_build.done ]; then
    cat "$prebuilt".part-* | tar xJf - -C "$full" \
      && PYTHONPATH=$full python3 -c "import mmcv._ext" \
      && touch /tmp/mmcv_build.started /tmp/mmcv_build.done \
      || { echo "the packed mmcv build does not load here: building"; rm -rf "$full"/mmcv "$full"/mmcv-*.dist-info; }
  fi
}

pack_mmcv() {  # the built mmcv (debug symbols stripped), for later fresh hosts to unpack into $full
  local site
  site=$(cd /tmp && PYTHONPATH=$full python3 -c "import mmcv, os; print(os.path.dirname(os.path.dirname(mmcv.__file__)))")
  strip --strip-debug "$site"/mmcv/_ext*.so
  tar cf - -C "$site" mmcv $(cd "$site" && ls -d mmcv-*.dist-info) | xz -T0 -6 \
    | split -b 15m - "$out/$(basename "$prebuilt").part-"
  ls -la "$out"
}

build_mmcv() {  # the stock baseline: mmcv 2.1.0's own CUDA ops for sm_90, into the system site (4-5 min)
  python3 -c "import mmcv._ext" 2>/dev/null && return 0
  rm -rf /tmp/mmcv-src && mkdir -p /tmp/mmcv-src && tar xzf .whl/src/mmcv-2.1.0.tar.gz -C /tmp/mmcv-src
  (cd /tmp/mmcv-src/mmcv-2.1.0 && PYTHONPATH=$full MMCV_WITH_OPS=1 FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 \
     MAX_JOBS=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps . > "$build_log" 2>&1)
}

start_mmcv_build() {  # once per host: later phases on the same (warm) host reuse the build
  [ -f /tmp/mmcv_build.started ] && return 0
  touch /tmp/mmcv_build.started
  # In its own session: a call that runs past its time limit is killed with its process group, and the build
  # (4 min alone on 16 cores, much longer beside the GPU tests) must outlive it for the next call to find it.
  export -f build_mmcv
  export full build_log
  setsid nohup bash -c 'build_mmcv; touch /tmp/mmcv_build.done' > /dev/null 2>&1 < /dev/null &
}

wait_for_mmcv() {
  start_mmcv_build
  while [ ! -f /tmp/mmcv_build.done ]; do sleep 5; done
  PYTHONPATH=$full python3 -c "import mmcv._ext, mmcv; print('stock mmcv', mmcv.__version__, 'with compiled ops')" \
    || { echo "mmcv's build failed: stock rows will fail"; tail -20 "$build_log"; }
}

# Every job ends before the phase's deadline, so that the results are packed even when a job runs long.
deadline=$(( SECONDS + ${PHASE_SECONDS:-560} ))
left() { local s=$(( deadline - SECONDS )); echo $(( s > 5 ? s : 5 )); }
with_lite() { PYTHONPATH="$lite:$repo" "$@"; }
with_full() { PYTHONPATH="$full:$repo" "$@"; }
on_gpu() { local gpu=$1; shift; CUDA_VISIBLE_DEVICES=$gpu "$@"; }
second_gpu=$(( gpus > 1 ? 1 : 0 ))

declare -A config_of=(
  [ddetr]=configs/fast/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py
  [ddetr-plain]=configs/fast/deformable-detr_r50_16xb2-50e_coco_deform-plugin-fast.py
  [ddetr-refine]=configs/fast/deformable-detr-refine_r50_16xb2-50e_coco_deform-plugin-fast.py
  [dino]=configs/fast/dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py
  [ddq]=configs/fast/ddq-detr-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py
  [mask2former]=configs/fast/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py
  [mask2former-panoptic]=configs/fast/mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin-fast.py)

install_wheels
case "$phase" in
tests)
  start_mmcv_build
  # TEST_PATHS picks the test files (default: all the GPU-relevant ones; a cold host needs more than one 10-minute
  # call for them, so split them, e.g. TEST_PATHS="tests/ops tests/models" then the integration files); -v names
  # each test in the log as it runs, so a run cut short by the time limit says how far it got.
  on_gpu 0 with_lite timeout $(( $(left) - 20 )) python3 -m pytest -v -rfEs -p no:cacheprovider ${TEST_PATHS:-tests/ops \
      tests/models tests/integration/test_mmdet_graph_inference.py tests/integration/mmdet_fast_paths} 2>&1 \
      | tee "$results/gpu_tests.log" | tail -25 &
  tests_pid=$!
  if [ "$second_gpu" = 1 ]; then
    on_gpu 1 with_lite timeout 150 python3 tools/bench_deform_sdpa.py --out "$results" \
        > "$results/bench_deform_sdpa.log" 2>&1
  fi
  wait_for_mmcv
  # On one GPU the timings wait for the tests: sharing the card and the host's cores skews the host-bound rows.
  [ "$second_gpu" = 0 ] && wait $tests_pid
  if [ "${ENTRY_BENCH:-1}" = 1 ]; then  # ENTRY_BENCH=0: the tests only
    on_gpu $second_gpu with_full timeout $(( $(left) - 15 )) python3 tools/bench_msda_entry.py --out "$results" 2>&1 \
        | tee "$results/bench_msda_entry.log" | tail -40
  fi
  wait $tests_pid
  ;;
train)
  # TRAIN_CONFIGS picks the configs (default ddetr dino mask2former; also ddetr-plain, ddetr-refine, ddq and
  # mask2former-panoptic) and INFERENCE=0 skips the batch-1 inference rows, so that
  # one GPU can run the phase in pieces of under 10 minutes; TRAIN_ITERS (default 100) lengthens the runs.
  wait_for_mmcv
  rows="stock:fp32 ours:bf16:cold ours:bf16 ours:bf16:no-buckets ours:fp32:no-buckets ours:fp32"
  run_train() {  # GPU NAME
    for mode in --serial ""; do  # the warmup command's time into empty caches, then into the default one
      TRITON_CACHE_DIR=/tmp/triton_cold_$2$mode on_gpu "$1" with_full python3 -m deform_plugin warmup \
          "${config_of[$2]}" --amp-dtype bfloat16 $mode 2>&1 | tail -1
    done
    on_gpu "$1" with_full python3 -m deform_plugin warmup "${config_of[$2]}" --amp-dtype bfloat16 2>&1 | tail -1
    on_gpu "$1" with_full timeout $(left) python3 tools/benchmark_train.py "${config_of[$2]}" --rows $rows \
        --iters ${TRAIN_ITERS:-100} --batch-size 2 --workers 4 --out-dir "$results/train_$2" \
        > "$results/train_$2.log" 2>&1
    tail -12 "$results/train_$2.log"
  }
  names=(${TRAIN_CONFIGS:-ddetr dino mask2former})
  if [ "$second_gpu" = 1 ]; then  # one config per GPU at a time
    for ((i = 0; i < ${#names[@]}; i += 2)); do
      run_train 0 "${names[i]}" &
      [ -n "${names[i+1]:-}" ] && run_train 1 "${names[i+1]}"
      wait
    done
  else
    for name in "${names[@]}"; do run_train 0 "$name"; done
  fi
  if [ "${INFERENCE:-1}" = 1 ]; then
    on_gpu 0 with_full timeout $(left) python3 tools/benchmark_infer.py \
        configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py \
        configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py \
        configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py --sizes coco16 distinct fixed \
        --rows stock:fp32 eager:fp32 graph:fp32 graph-canvas:fp32 graph:bf16 graph-canvas:bf16 --images 64 \
        --out-dir "$results/inference" > "$results/inference.log" 2>&1
    tail -30 "$results/inference.log"
  fi
  ;;
scale)
  wait_for_mmcv
  if [ "$gpus" -ge 2 ]; then
    for name in ${SCALE_CONFIGS:-ddetr}; do
      # One run on one GPU, then on two: the report's scaling table and each rank's compute, all-reduce and wait.
      with_full timeout $(left) python3 tools/benchmark_train.py "${config_of[$name]}" --rows ours:bf16 \
          --iters ${SCALE_ITERS:-100} --batch-size 2 --workers 4 \
          --gpus 1 2 --out-dir "$results/ddp_${name}" > "$results/ddp_${name}.log" 2>&1
      tail -16 "$results/ddp_${name}.log"
    done
  fi
  if [ "${DEMO:-1}" = 1 ]; then  # DEMO=0 leaves the demo's loss curves out
    demo_plain=configs/demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py
    demo_fast=configs/fast/deformable-detr-refine_r18_tiny_1xb4-500i_shapes-fast.py
    DEFORM_PLUGIN_BACKEND=mmcv on_gpu 0 with_full timeout $(left) python3 tools/train.py $demo_plain \
        --work-dir "$results/demo_fp32_mmcv" > "$results/demo_fp32_mmcv.log" 2>&1 &
    on_gpu $second_gpu with_full timeout $(left) python3 tools/train.py $demo_fast --amp-dtype bfloat16 \
        --work-dir "$results/demo_bf16_fast" > "$results/demo_bf16_fast.log" 2>&1
    wait
    grep -h "bbox_mAP" "$results"/demo_*.log | tail -4
  fi
  if [ "${PROFILE:-1}" = 1 ]; then  # PROFILE=0 leaves the step profile to the profile phase
    on_gpu 0 with_full timeout $(left) python3 tools/profile_step.py \
        configs/fast/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py \
        --rows stock:fp32 triton:bf16:none triton:bf16:config --profile-steps 3 --no-progress \
        --out-dir "$results" --name profile > "$results/profile.log" 2>&1
    tail -20 "$results/profile.log"
  fi
  ;;
profile)
  wait_for_mmcv
  on_gpu 0 with_full timeout $(left) python3 tools/profile_step.py \
      configs/fast/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py \
      --rows stock:fp32 triton:bf16:none triton:bf16:config --profile-steps 3 --no-progress \
      --out-dir "$results" --name profile > "$results/profile.log" 2>&1
  tail -20 "$results/profile.log"
  ;;
ops)
  wait_for_mmcv
  entry() {  # NAME ARGS...: one run of the MSDA entry benchmark into its own folder
    local name=$1; shift
    on_gpu 0 with_full timeout $(left) python3 tools/bench_msda_entry.py --out "$results/$name" "$@" \
        > "$results/$name.log" 2>&1
    tail -40 "$results/$name.log"
  }
  entry entry_uniform --cases encoder_b2,mask2former_b2,decoder_q300,decoder_q900 --dists uniform --dtypes fp32,bf16
  entry entry_realistic --cases encoder_b2 --dists realistic --dtypes fp32,bf16
  entry host_split --cases decoder_q300,decoder_q900 --dists uniform --dtypes fp32 --host-split
  on_gpu 0 with_full timeout $(left) python3 tools/bench_msda.py --cases encoder_b2,decoder_q300 --dtypes fp32,bf16 \
      --dists uniform --deterministic --out "$results/deterministic" > "$results/deterministic.log" 2>&1
  tail -16 "$results/deterministic.log"
  for dtype in fp32 bf16; do
    on_gpu 0 with_full timeout $(left) python3 tools/bench_deform_sdpa.py --out "$results/sdpa_$dtype" --dtype $dtype \
        --sizes 14 --modes fwd fwd+bwd > "$results/sdpa_$dtype.log" 2>&1
    tail -8 "$results/sdpa_$dtype.log"
  done
  ;;
build)
  wait_for_mmcv  # only the stock baseline's build, so that later phases of a fresh host start timing at once
  [ "${PACK:-0}" = 1 ] && pack_mmcv
  ;;
sizes)
  # The cost of a new input size: training steps at random-resize sizes, each first new, then seen (benchmark.py
  # --variable-sizes); all = every exact fast path, config = the fast config (with its ShapeBucketsHook padding).
  wait_for_mmcv
  on_gpu 0 with_full timeout $(left) python3 tools/benchmark.py \
      configs/fast/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py \
      --rows stock:fp32 triton:fp32:all triton:fp32:config triton:bf16:all triton:bf16:config --warmup 3 --steps 5 \
      --variable-sizes 16 --inference-steps 0 --no-progress --out-dir "$results" --name sizes \
      > "$results/sizes.log" 2>&1
  tail -22 "$results/sizes.log"
  ;;
borrow)
  wait_for_mmcv
  for name in ${BORROW_CONFIGS:-ddetr dino}; do
    variants=()
    for setting in ${BORROW_SETTINGS:-1,1.5}; do
      variant="$results/${name}_borrow_${setting/,/_}.py"
      with_full python3 -m deform_plugin.benchmarks.detector.borrow_variant "$repo/${config_of[$name]}" \
          "${setting%,*}" "${setting#*,}" > "$variant"
      variants+=("$variant")
    done
    on_gpu 0 with_full timeout $(left) python3 tools/benchmark_train.py "${config_of[$name]}" "${variants[@]}" \
        --rows ours:bf16 --iters ${BORROW_ITERS:-150} --steady-start $(( ${BORROW_ITERS:-150} / 2 + 1 )) \
        --batch-size 2 --workers 4 --out-dir "$results/borrow_$name" > "$results/borrow_$name.log" 2>&1
    tail -8 "$results/borrow_$name.log"
  done
  ;;
memory)
  wait_for_mmcv
  exact="optim+sdpa+matching+losses+batched+forward+graph"
  on_gpu 0 with_full timeout $(left) python3 tools/benchmark.py \
      configs/fast/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py \
      configs/fast/dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py \
      --rows stock:fp32 triton:bf16:$exact triton:bf16:$exact+ffn --warmup 5 --steps 20 --inference-steps 0 \
      --no-progress --out-dir "$results" --name memory > "$results/memory.log" 2>&1
  tail -24 "$results/memory.log"
  ;;
multinode)
  # tools/dist_train.sh as two nodes on this host (tests/tools/test_two_nodes.py): one GPU per node, NCCL over TCP
  # sockets (the variant needs two GPUs), and CPU ranks over gloo.
  with_lite timeout $(( $(left) - 10 )) python3 -m pytest -v -rfEs -p no:cacheprovider tests/tools/test_two_nodes.py \
      2>&1 | tee "$results/two_nodes.log" | tail -25
  ;;
parity)
  wait_for_mmcv
  # Runs, logs and checkpoints in the results folder (checkpoints are deleted before packing); the report in OUT.
  with_full timeout $(left) python3 tools/ap_parity.py --configs ddetr dino \
      --rows ${PARITY_ROWS:-stock:fp32 ours:fp32 ours:bf16 ours:bf16:no-buckets} --seeds 0 1 2 \
      --iters ${PARITY_ITERS:-auto} --deadline $(( $(left) - 15 )) --work-dir "$results/work" --out-dir "$out" \
      ${PARITY_ARGS:-} 2>&1 | tee "$results/ap_parity.log"
  ;;
*)
  echo "unknown phase $phase" >&2; exit 2;;
esac
cp -f "$build_log" "$results/" 2>/dev/null
find "$results" -name "*.pth" -delete
tar czf "$out/results-$phase.tgz" -C "$repo/bench_results" "gpu-$phase"
ls -la "$out"
