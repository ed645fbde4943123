#!/usr/bin/env bash
# Downloads the wheels that travel with the checkout to the GPU check machine (no network there),
# for its Python 3.12 on linux x86_64, into .whl/ (git-ignored; name it in the device call's carry):
#   nvshmem4py-cu13 and what it needs that the machine lacks (cuda-python, cuda-bindings,
#   cuda-core, cuda-pathfinder, Cython: the machine has numpy and nvidia-nvshmem-cu13), for
#   tests/gpu/test_gpu_nvshmem4py.py; libucx-cu13 for the optional network-path step.
# Pinned, so that what travels is known: scripts/gpu_check.sh --dry-run checks that these install
# offline for Python 3.12 (every requirement carried or on the machine) and fit 64 MiB.
#
#   scripts/fetch_gpu_wheels.sh [DIR]     (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
WHEELS=(nvshmem4py-cu13==0.4.1 cuda-python==13.4.4 cuda-bindings==13.4.4 cuda-core==1.2.2 cuda-pathfinder==1.9.1
        Cython==3.3.1 libucx-cu13==1.22.0)
mkdir -p "$DIR"
"$PY" -m pip download --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "${WHEELS[@]}"
total=0
for f in "$DIR"/*.whl; do
  size=$(stat -c %s "$f")
  total=$((total + size))
  echo "$(basename "$f") $size"
done
# A device call carries the working tree (tracked files and untracked ones git does not ignore)
# with the wheels, 64 MiB in all: where both are over, the optional network path's libucx stays
# behind (run that step in a call of its own, with libucx and without nvshmem4py's wheels).
tree=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
if [ $((total + tree)) -gt $((64 * 1048576)) ]; then
  for f in "$DIR"/libucx_cu13-*.whl; do
    [ -f "$f" ] || continue
    total=$((total - $(stat -c %s "$f")))
    rm -f "$f"
    echo "fetch_gpu_wheels: left out $(basename "$f"): with the $tree-byte working tree it is over the 64 MiB a device call carries (the network-path step is skipped)"
  done
fi
echo "fetch_gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $total bytes ($((total / 1048576)) MiB) in $DIR, working tree $tree bytes"
[ $((total + tree)) -le $((64 * 1048576)) ] || { echo "fetch_gpu_wheels: over the 64 MiB a device call carries" >&2; exit 1; }
