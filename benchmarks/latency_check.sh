#!/usr/bin/env bash
# The CPU latency check in one run (docs/results.md, "CPU latency check"): the old build
# (default commit 9a7423a, OLD_COMMIT) beside this checkout's build, cold and warm, 8 KB-16 MB,
# and nvrar beside DeepSpeed's shm all-reduce and the MPI_Allreduce of Open MPI, MPICH and Intel
# MPI, 2 and 4 ranks; prints every ratio with PASS or FAIL and ends with
# "latency_check: N passed, M failed".
#
#   benchmarks/latency_check.sh [--json out.json] [--rounds 3] [--quantile 0.5] [--busy]
#
# Needs: this checkout installed (pip install -e '.[test]', NVRAR_CUDA=0 is enough), mpirun and
# mpi4py (the [test] extra brings both), and for the DeepSpeed peer `pip install deepspeed` (its
# CPU shm op builds itself on first use, about a minute, cached under ~/.cache/torch_extensions).
# MPICH and Intel MPI run where their wheels are installed (docs/configuration.md, "Other MPI
# libraries": pip install --target DIR, NVRAR_MPICH_PREFIX / NVRAR_IMPI_PREFIX=DIR); else a
# "# skipped:" line says what is missing. --busy runs one spinning process per two ranks through
# the timed part. The old build is installed once into OLD_DIR (default
# /tmp/nvrar-old-9a7423a; about 2 minutes, before the timed part). The measurement itself stops
# after MEASURE_S seconds (default 480).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD_COMMIT=${OLD_COMMIT:-9a7423a}
OLD_DIR=${OLD_DIR:-/tmp/nvrar-old-$OLD_COMMIT}
MEASURE_S=${MEASURE_S:-480}
PY=${PYTHON:-python}

if [ ! -f "$OLD_DIR/nvrar/__init__.py" ]; then
  echo "# installing the old build ($OLD_COMMIT) into $OLD_DIR"
  src=$(mktemp -d)
  git archive "$OLD_COMMIT" | tar -x -C "$src"
  "$PY" -m pip install -q pybind11 setuptools >/dev/null
  NVRAR_CUDA=0 "$PY" -m pip install -q --no-deps --no-build-isolation --target "$OLD_DIR" "$src"
  rm -rf "$src"
fi
if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  echo "# deepspeed is not importable: its rows are skipped (pip install deepspeed to compare against it)"
fi
echo "# $(date -u +%FT%TZ) $(uptime)"
echo "# new build: $(git rev-parse --short HEAD); old build: $OLD_COMMIT at $OLD_DIR"
exec timeout --kill-after=20 "$MEASURE_S" "$PY" benchmarks/latency_check.py --old-path "$OLD_DIR" \
  --budget-s $((MEASURE_S - 90)) "$@"
