#!/usr/bin/env bash
# The one-GPU check of the GPU executor, in at most about 8 minutes on a single H200:
#   1. build and install nvrar with the GPU executor (no network needed: it builds against the
#      pybind11, setuptools and nvidia-nvshmem-cu13 already installed),
#   2. run tests/gpu with several processes sharing the GPU (NVSHMEM's multi-process-per-GPU
#      mode) and ranks_per_node < world, so that the "inter-node" steps go through NVSHMEM,
#   3. a latency sweep 8 KB - 2 MB of nvrar against NVSHMEM's own reduction in the same run
#      (under MPS, which NVSHMEM's collectives need when PEs share a GPU),
# everything into one log:  scripts/gpu_check.sh [LOG]   (default $OUT/gpu_check.log or ./gpu_check.log)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-.}
LOG=${1:-$OUTDIR/gpu_check.log}
exec > >(tee "$LOG") 2>&1
PY=${PYTHON:-python3}
status=0
section() { echo; echo "=== $* ($(date +%T))"; }
step() {  # step SECONDS COMMAND...: run with a deadline, remember a failure
  local limit=$1; shift
  echo "+ $*"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  [ $rc -eq 0 ] || { echo "!! exit $rc: $*"; status=1; }
  return $rc
}

section "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY - <<'PY'
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import importlib.metadata as md
    print("nvidia-nvshmem-cu13", md.version("nvidia-nvshmem-cu13"))
except Exception as exc:
    print("nvidia-nvshmem-cu13: not installed", exc)
PY

section "build (sm_${NVRAR_CUDA_ARCHS:-90})"
export NVRAR_CUDA=1 NVRAR_CUDA_ARCHS=${NVRAR_CUDA_ARCHS:-90}
step 420 $PY -m pip install --no-build-isolation --no-deps -e . || { echo "build failed"; exit 1; }
$PY -c "import nvrar, json; print(json.dumps(nvrar.build_info()))"

# One GPU, several PEs: no network transport, no NVLS/NCCL inside NVSHMEM, bootstrap on loopback.
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export NVSHMEM_DISABLE_NCCL=${NVSHMEM_DISABLE_NCCL:-1}
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-1G}
env | grep '^NVSHMEM_' | sort

section "GPU tests (several processes on one GPU)"
step 300 $PY -m pytest tests/gpu -x -q -rs -p no:cacheprovider

section "latency sweep 8K-2M: 4 ranks, 2 per node, nvrar vs NVSHMEM reduce (MPS)"
mps=0
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then mps=1; echo "MPS started"; else echo "MPS not available: the NVSHMEM peer will be skipped"; fi
step 240 $PY -m nvrar.bench --device cuda --launcher local --ranks 4 --ranks-per-node 2 --min-bytes 8K \
  --max-bytes 2M --iters 60 --warmup 5 --backends nvrar,nccl,nvshmem --buffers ordinary,symmetric \
  --json "$OUTDIR/gpu_sweep.json"
[ $mps -eq 1 ] && { echo quit | nvidia-cuda-mps-control; }

section "done: status $status"
exit $status
