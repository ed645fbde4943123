#!/bin/bash
# nvrar-bench on a Slingshot-11 cluster (Perlmutter-like: 4 GPUs and 4 NICs per node, NVSHMEM over
# libfabric/cxi), for 2, 4, 8 and 16 nodes (as many as the allocation has), one JSON per node count.
#
#   sbatch -N 16 scripts/slurm_slingshot.sh [extra nvrar-bench arguments]
#
# Variables already set in the environment are kept (never overwritten); the script prints every
# value it uses.
#SBATCH -J nvrar-bench
#SBATCH -C gpu
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH -t 00:30:00
set -euo pipefail

setdefault() {  # setdefault NAME VALUE REASON: export NAME=VALUE unless the user set NAME
  local name=$1 value=$2 reason=$3
  if [ -z "${!name+x}" ]; then export "$name=$value"; echo "set  $name=$value  ($reason)"
  else echo "kept $name=${!name}  (set by the user)"; fi
}

# NVSHMEM (nvrar's GPU executor)
setdefault NVSHMEM_REMOTE_TRANSPORT libfabric "Slingshot has no InfiniBand verbs: NVSHMEM's libfabric transport"
setdefault NVSHMEM_LIBFABRIC_PROVIDER cxi "the Slingshot-11 libfabric provider"
setdefault NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME hsn0 "nvrar's unique-id bootstrap socket on the high-speed network"
setdefault NVSHMEM_SYMMETRIC_SIZE 1G "symmetric heap per GPU: staging, landing zones and empty() buffers"
# libfabric/cxi and NCCL (the peer, through aws-ofi-nccl); HPE's recommended settings for
# collectives on Slingshot (github.com/HewlettPackard/shs-ccl-docs, ccl_env.sh)
setdefault FI_CXI_DISABLE_HOST_REGISTER 1 "CUDA allocations can deadlock with cxi host-memory registration"
setdefault FI_MR_CACHE_MONITOR userfaultfd "memory-registration cache monitor that works with CUDA"
setdefault FI_CXI_DEFAULT_CQ_SIZE 131072 "completion queue large enough for many peers"
setdefault NCCL_CROSS_NIC 1 "Slingshot is not rail-optimized: let NCCL use any NIC"
setdefault NCCL_NET_GDR_LEVEL PHB "GPUDirect RDMA between a GPU and a NIC under the same host bridge"
setdefault NCCL_SOCKET_IFNAME hsn "NCCL's bootstrap sockets on the high-speed network"

NODES=${SLURM_JOB_NUM_NODES:?run under sbatch or salloc}
GPUS=${SLURM_GPUS_PER_NODE:-4}
OUT=${NVRAR_RESULTS:-results/slingshot-job${SLURM_JOB_ID:-0}}
mkdir -p "$OUT"
for n in 2 4 8 16; do
  [ "$n" -le "$NODES" ] || break
  echo "== $n nodes x $GPUS GPUs -> $OUT/nvrar-bench-${n}x${GPUS}.json"
  srun -N "$n" --ntasks-per-node="$GPUS" --gpus-per-node="$GPUS" --cpu-bind=none \
    nvrar-bench --device cuda --min-bytes 8K --max-bytes 16M \
    --json "$OUT/nvrar-bench-${n}x${GPUS}.json" "$@" | tee "$OUT/nvrar-bench-${n}x${GPUS}.txt"
done
echo "== done; calibrate the planner with: nvrar fit $OUT/*.json --profile perlmutter -o $OUT/fitted.json"
