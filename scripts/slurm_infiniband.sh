#!/bin/bash
# nvrar-bench on an InfiniBand cluster (DGX-like: 8 GPUs per node, one NDR NIC per GPU), for 2, 4,
# 8 and 16 nodes (as many as the allocation has), one JSON per node count. NVSHMEM uses IBGDA
# (GPU-initiated RDMA, no CPU proxy) by default; NVRAR_IB_TRANSPORT=ibrc selects the proxy-based
# reliable-connection transport instead (for NICs or drivers without IBGDA).
#
#   sbatch -N 16 scripts/slurm_infiniband.sh [extra nvrar-bench arguments]
#
# Variables already set in the environment are kept (never overwritten); the script prints every
# value it uses.
#SBATCH -J nvrar-bench
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH -t 00:30:00
set -euo pipefail

setdefault() {  # setdefault NAME VALUE REASON: export NAME=VALUE unless the user set NAME
  local name=$1 value=$2 reason=$3
  if [ -z "${!name+x}" ]; then export "$name=$value"; echo "set  $name=$value  ($reason)"
  else echo "kept $name=${!name}  (set by the user)"; fi
}

TRANSPORT=${NVRAR_IB_TRANSPORT:-ibgda}
# NVSHMEM (nvrar's GPU executor)
setdefault NVSHMEM_REMOTE_TRANSPORT ibrc "the InfiniBand transport family (IBGDA is enabled on top of it below)"
if [ "$TRANSPORT" = ibgda ]; then
  setdefault NVSHMEM_IB_ENABLE_IBGDA 1 "GPU-initiated RDMA: puts and signals leave from the kernel, no CPU proxy"
fi
setdefault NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME ib0 "nvrar's unique-id bootstrap socket on IPoIB (change to the management NIC if ib0 has no IP)"
setdefault NVSHMEM_SYMMETRIC_SIZE 1G "symmetric heap per GPU: staging, landing zones and empty() buffers"
# NCCL (the peer)
setdefault NCCL_SOCKET_IFNAME ib0 "NCCL's bootstrap sockets on IPoIB"

NODES=${SLURM_JOB_NUM_NODES:?run under sbatch or salloc}
GPUS=${SLURM_GPUS_PER_NODE:-8}
OUT=${NVRAR_RESULTS:-results/infiniband-$TRANSPORT-job${SLURM_JOB_ID:-0}}
mkdir -p "$OUT"
for n in 2 4 8 16; do
  [ "$n" -le "$NODES" ] || break
  echo "== $n nodes x $GPUS GPUs ($TRANSPORT) -> $OUT/nvrar-bench-${n}x${GPUS}.json"
  srun -N "$n" --ntasks-per-node="$GPUS" --gpus-per-node="$GPUS" \
    nvrar-bench --device cuda --min-bytes 8K --max-bytes 16M \
    --json "$OUT/nvrar-bench-${n}x${GPUS}.json" "$@" | tee "$OUT/nvrar-bench-${n}x${GPUS}.txt"
done
echo "== done; calibrate the planner with: nvrar fit $OUT/*.json --profile h100-ndr400 -o $OUT/fitted.json"
