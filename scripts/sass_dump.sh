#!/usr/bin/env bash
# Dumps `cuobjdump -sass` of every GPU kernel instance (the 12 all-reduce and 3 fused units,
# compiled as setup.py compiles them, for one arch) into one file per unit under OUT_DIR, so that
# two trees can be compared: scripts/sass_dump.sh OUT_DIR [ARCH]   (ARCH default 90)
# Needs nvcc, cuobjdump (CUOBJDUMP=path, or on PATH; the nvidia-cuda-cuobjdump wheel has one) and the
# NVSHMEM headers (NVSHMEM_HOME, or the nvidia-nvshmem wheel of the python on PATH).
set -euo pipefail
out=${1:?usage: sass_dump.sh OUT_DIR [ARCH]}
arch=${2:-90}
root=$(cd "$(dirname "$0")/.." && pwd)
home=${NVSHMEM_HOME:-$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')}
cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
mkdir -p "$out"
jobs=${NVRAR_BUILD_JOBS:-1}
units=()
for t in float f16 bf16 int32_t; do for op in OpSum OpMax OpMin; do
  units+=("allreduce_inst.cu|-DNVRAR_INST_T=$t -DNVRAR_INST_OP=$op|allreduce_${t}_${op}"); done; done
for t in float f16 bf16; do units+=("fused_inst.cu|-DNVRAR_INST_T=$t|fused_${t}"); done
compile() {
  IFS='|' read -r src defs name <<<"$1"
  # shellcheck disable=SC2086
  nvcc -std=c++17 -O3 -rdc=true -t 0 "-gencode=arch=compute_${arch},code=sm_${arch}" \
    -Xcompiler -fPIC,-fvisibility=hidden -Xptxas -O3 "-DNVRAR_CUDA_ARCHS=\"${arch}\"" $defs \
    -I"$root/csrc" -I"$home/include" -I"$cuda_home/include" -c "$root/csrc/cuda/$src" -o "$out/$name.o"
  "${CUOBJDUMP:-cuobjdump}" -sass "$out/$name.o" | grep -v '^\s*$' >"$out/$name.sass"
}
export -f compile; export CUOBJDUMP root home cuda_home arch out
printf '%s\n' "${units[@]}" | xargs -P "$jobs" -I{} bash -c 'compile "$@"' _ {}
ls "$out"/*.sass | wc -l
