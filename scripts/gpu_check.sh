#!/usr/bin/env bash
# The one-GPU check of the GPU executor: one device call (at most 540 s of wall time on a fresh
# one-H200 machine with no network) gives a complete verdict.
#
#   scripts/gpu_check.sh            the check; everything lands in $OUT (or ./gpu_check-out)
#   scripts/gpu_check.sh --dry-run  what can be checked without a GPU (CI runs it): the environment
#                                   functions, the CUDA build (reused when installed), collection of
#                                   tests/gpu, the sweep's arguments; ends with
#                                   "gpu_check dry-run: budget N s"
#   options: --no-netpath (skip the network-path step), --out DIR
#
# Steps, each with its own deadline inside the budget (the sum is the budget; a step never runs
# past the time left, and a step that overruns is stopped with its whole process group):
#   setup   machine, MPS started first and proved (control daemon with pipe/log dirs under /tmp,
#           a tiny CUDA client, the server list, the compute mode);
#           CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / (most PEs sharing the GPU) so that NVSHMEM
#           leaves its limited multi-process-per-GPU mode (the PEs' percentages must sum <= 100)
#   wheels  nvshmem4py and what it needs that the machine lacks, installed offline from the wheels
#           carried in .whl/ (scripts/fetch_gpu_wheels.sh), for tests/gpu/test_gpu_nvshmem4py.py
#   build   the GPU executor for sm_90 only, 12 kernel units compiled in parallel, in place
#           (python setup.py build_ext --inplace; no pip, no network: it uses the pybind11,
#           setuptools and nvidia-nvshmem-cu13 installed there, so headers and library match)
#   info    nvrar.build_info() and NVSHMEM's view of the PEs
#   tests   pytest tests/gpu -v, per-test timeouts, the reduced load (NVRAR_GPU_TEST_LOAD=reduced);
#           without MPS a minimal set and load instead (said in the log)
#   sweep   latency 8 KB - 1 MB, 4 ranks, 2 per node: nvrar vs NCCL vs NVSHMEM's reduce -> JSON
#   netpath optional (needs .whl/libucx_cu13-*.whl carried): 2 PEs, ranks_per_node=1,
#           NVSHMEM_DISABLE_P2P=1, NVSHMEM_REMOTE_TRANSPORT=ucx over TCP on loopback, so that the
#           inter-node steps go through NVSHMEM's host proxy (docs/gpu/README.md says what this can
#           and cannot exercise)
# Files under $OUT (at most 8): gpu_check.log (everything, MPS log appended), gpu_build.log,
# gpu_sweep.json, gpu_pytest.xml. The log's last lines are written whatever happens (trap).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0
NETPATH=auto
OUTDIR=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --no-netpath) NETPATH=off ;;
    --netpath) NETPATH=on ;;
    --out) shift; OUTDIR=${1:?--out needs a directory} ;;
    -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$OUTDIR" ]; then
  if [ $DRY -eq 1 ]; then OUTDIR=$(mktemp -d /tmp/gpu_check-dry.XXXXXX); else OUTDIR=$ROOT/gpu_check-out; fi
fi
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.log
: >"$LOG"

# Step deadlines (seconds). Their sum is the budget; at most 540 (a device command may run 600).
T_SETUP=25 T_WHEELS=15 T_BUILD=130 T_INFO=15 T_TESTS=195 T_SWEEP=100 T_NETPATH=55
PER_TEST_TIMEOUT=75      # pytest-timeout, per test (the launcher's own deadline is below it)
LAUNCH_TIMEOUT=60        # tests/_launch.py: ranks still running are killed and reported
MAX_PES=4                # most PEs sharing the GPU in any step (tests and sweep)
BUDGET=$((T_SETUP + T_WHEELS + T_BUILD + T_INFO + T_TESTS + T_SWEEP + T_NETPATH))
WHEELS=$ROOT/.whl         # carried wheels (scripts/fetch_gpu_wheels.sh): nvshmem4py and its stack, libucx
START=$(date +%s)
PY=${PYTHON:-python3}
sweep_args() {  # $1: the backends
  SWEEP_ARGS=(--device cuda --launcher local --ranks 4 --ranks-per-node 2 --min-bytes 8K --max-bytes 1M
              --iters 40 --warmup 5 --backends "$1" --buffers ordinary,symmetric --json "$OUTDIR/gpu_sweep.json")
}
sweep_args nvrar,nccl,nvshmem

# Everything into the log file (written by each process directly: nothing left in a pipe when
# the command ends); the original stdout gets the log's tail at the end.
exec 3>&1
exec >>"$LOG" 2>&1
status=0
MPS=0
verdict=()
say() { echo "$*"; }
section() { echo; echo "=== $* (t=$(($(date +%s) - START)) s, $(date +%T))"; }
note() { verdict+=("$*"); echo ">> $*"; }

finish() {
  local rc=$?
  trap - EXIT INT TERM
  [ $MPS -eq 1 ] && mps_stop
  section "verdict"
  for v in "${verdict[@]}"; do echo "  $v"; done
  [ -f "$ROOT/build/nvrar-cuda-build.log" ] && cp "$ROOT/build/nvrar-cuda-build.log" "$OUTDIR/gpu_build.log" 2>/dev/null
  echo "gpu_check: status $status, $(($(date +%s) - START)) s of a $BUDGET s budget"
  if [ $DRY -eq 1 ]; then echo "gpu_check dry-run: budget $BUDGET s"; fi
  sync
  tail -n 200 "$LOG" >&3
  [ $status -eq 0 ] && exit "$rc" || exit 1
}
trap finish EXIT
trap 'echo "!! gpu_check: interrupted"; status=1; exit 1' INT TERM

# run_step NAME SECONDS CMD...: CMD in its own process group, stopped (TERM, then KILL) at its
# deadline or when the budget runs out, whichever comes first.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((START + BUDGET - $(date +%s)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 0 ]; then note "$name: SKIPPED, no time left"; status=1; return 124; fi
  echo "+ [$name, deadline ${limit} s] $*"
  local t0
  t0=$(date +%s)
  setsid bash -c '"$@"' run_step "$@" &  # a new process group; shell functions are exported
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(($(date +%s) - t0)) -ge "$limit" ]; then
      echo "!! $name: deadline ${limit} s passed: stopping its process group $pid"
      kill -TERM -- "-$pid" 2>/dev/null
      sleep 3
      kill -KILL -- "-$pid" 2>/dev/null
      break
    fi
    sleep 1
  done
  wait "$pid"
  local rc=$?
  echo "[$name: exit $rc after $(($(date +%s) - t0)) s]"
  return $rc
}

# --- environment functions (the dry run calls them too) ---------------------------------------

nvshmem_env() {  # one GPU, several PEs: no network transport, no NVLS/NCCL, bootstrap on loopback
  export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
  export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
  export NVSHMEM_DISABLE_NCCL=${NVSHMEM_DISABLE_NCCL:-1}
  export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
  export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-1G}
}

mps_env() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvrar-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/nvrar-mps/log
  # NVSHMEM's full multi-process-per-GPU mode needs the PEs' percentages to sum to <= 100.
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / MAX_PES))
}

test_env() {  # $1: reduced (MPS) or minimal (no MPS); a test skipped for want of a GPU is an error
  export NVRAR_GPU_TEST_LOAD=$1 NVRAR_GPU_LAUNCH_TIMEOUT=$LAUNCH_TIMEOUT NVRAR_GPU_REQUIRED=1
}

netpath_env() {  # $1: directory of the unpacked libucx wheel
  export LD_LIBRARY_PATH=$1/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export NVSHMEM_REMOTE_TRANSPORT=ucx NVSHMEM_DISABLE_P2P=1
  export UCX_TLS=tcp,cuda_copy,self UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
  export NVRAR_GPU_TEST_LOAD=minimal NVRAR_GPU_LAUNCH_TIMEOUT=$((T_NETPATH - 10))
}

compute_mode() { nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>&1 | head -1; }

mps_start() {
  mps_env
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  echo "compute mode: $(compute_mode)"
  command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control"; return 1; }
  nvidia-cuda-mps-control -d || { echo "nvidia-cuda-mps-control -d failed"; return 1; }
  MPS=1
  # Proof: a tiny client must get a context through the server, and the server must be listed.
  timeout 20 "$PY" -c "import torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); \
print('MPS client: sum', float(x.sum()), 'with', __import__('os').environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'], '% threads')" \
    || { echo "MPS client failed"; return 1; }
  local servers
  servers=$(echo get_server_list | timeout 5 nvidia-cuda-mps-control 2>&1)
  echo "MPS servers: ${servers:-none}"
  [ -n "$servers" ] && [[ "$servers" =~ ^[0-9] ]] || { echo "no MPS server answered"; return 1; }
  echo "compute mode with MPS: $(compute_mode)"
}

mps_stop() {
  echo quit | timeout 10 nvidia-cuda-mps-control 2>&1 || true
  sleep 1
  section "MPS log"
  cat "${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvrar-mps/log}"/control.log "${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvrar-mps/log}"/server.log 2>/dev/null | tail -n 60
  MPS=0
}

build() {  # the GPU executor in place, sm_90 only, NVRAR_BUILD_JOBS compilers at once
  export NVRAR_CUDA=1 NVRAR_CUDA_ARCHS=${NVRAR_CUDA_ARCHS:-90} NVRAR_BUILD_JOBS=${NVRAR_BUILD_JOBS:-$(nproc)}
  "$PY" setup.py -q build_ext --inplace
}

# The carried wheels, checked for the GPU machine (Python 3.12, linux x86_64) without installing:
# every wheel's tags fit it, every requirement of nvshmem4py's closure is carried or on the machine
# already (numpy, nvidia-nvshmem-cu13), all of it fits the 64 MiB a device call carries, and pip
# itself installs them from the folder alone (--no-index --dry-run for that interpreter).
wheels_check() {  # $1: the folder
  "$PY" - "$1" <<'PY' || return 1
import email.parser, os, re, sys, zipfile
try:
    from packaging import markers, requirements, tags, utils
except ImportError:
    from pip._vendor.packaging import markers, requirements, tags, utils
folder = sys.argv[1]
ON_MACHINE = {"numpy", "nvidia-nvshmem-cu13"}  # the GPU machine's own (README.md of docs/gpu)
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
ok_tags = set(tags.cpython_tags((3, 12), platforms=["manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                    "manylinux2014_x86_64", "linux_x86_64"]))
ok_tags |= set(tags.compatible_tags((3, 12), "cp312", ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                          "manylinux2014_x86_64", "linux_x86_64"]))
carried, reqs, total, bad = {}, [], 0, []
for f in sorted(os.listdir(folder)):
    if not f.endswith(".whl"):
        continue
    total += os.path.getsize(os.path.join(folder, f))
    name, version, _, wtags = utils.parse_wheel_filename(f)
    if not set(wtags) & ok_tags:
        bad.append(f"{f}: no tag for CPython 3.12 on manylinux_2_28 x86_64")
    carried[str(name)] = str(version)
    with zipfile.ZipFile(os.path.join(folder, f)) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    for r in msg.get_all("Requires-Dist") or []:
        req = requirements.Requirement(r)
        if req.marker is None or req.marker.evaluate(env):
            reqs.append((f, req))
for f, req in reqs:
    name = utils.canonicalize_name(req.name)
    if name in carried:
        if not req.specifier.contains(carried[name], prereleases=True):
            bad.append(f"{f} needs {req}, {name} {carried[name]} is carried")
    elif name not in ON_MACHINE:
        bad.append(f"{f} needs {req}: neither carried nor on the GPU machine")
if "nvshmem4py-cu13" not in carried:
    bad.append("no nvshmem4py-cu13 wheel")
print(f"wheels: {len(carried)} carried, {total} bytes ({total / 2**20:.1f} MiB): "
      + ", ".join(f"{k} {v}" for k, v in sorted(carried.items())))
if total > 64 * 2**20:
    bad.append(f"{total} bytes is over the 64 MiB a device call carries")
for b in bad:
    print("wheels:", b)
sys.exit(1 if bad else 0)
PY
  local names
  names=$(ls "$1"/*.whl | xargs -n1 basename | sed 's/-[0-9].*//' | tr '_' '-' | sort -u)
  # shellcheck disable=SC2086
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip --isolated install --dry-run --no-index --find-links "$1" --no-deps --only-binary :all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --target "$(mktemp -d /tmp/gpu_check-wheels.XXXXXX)" $names
}

# On the GPU machine: nvshmem4py from the carried wheels, resolved against what is installed there.
wheels_install() {  # $1: the folder
  # the carried folder alone (--isolated: no PIP_* variables, no user configuration)
  export PIP_CONFIG_FILE=/dev/null
  "$PY" -m pip --isolated install --no-index --find-links "$1" --no-compile -q nvshmem4py-cu13 \
    || "$PY" -m pip --isolated install --no-index --find-links "$1" --no-compile -q --break-system-packages \
      nvshmem4py-cu13 \
    || return 1
  "$PY" -m pip check || echo "(pip check complains: see above; the tests say whether it matters)"
  "$PY" -c "import nvshmem.core, nvrar._gpu as g; print('nvshmem4py', g.nvshmem4py_version(), 'imports')"
}

sweep_args_check() {  # the sweep's command line, parsed and validated as far as a machine without GPU can
  "$PY" - "$@" <<'PY'
import sys
from nvrar.bench import build_parser, _validate
p = build_parser()
args = p.parse_args(sys.argv[1:])
args.device = "cpu"  # the CUDA checks need a GPU; every other check runs
_validate(p, args)
print("sweep arguments parse:", {k: v for k, v in vars(args).items() if k in ("ranks", "ranks_per_node", "min_bytes",
                                                                                 "max_bytes", "iters", "backends")})
PY
}

export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PY ROOT T_NETPATH LAUNCH_TIMEOUT
export -f build sweep_args_check nvshmem_env netpath_env wheels_check wheels_install

# --- dry run ------------------------------------------------------------------------------------
if [ $DRY -eq 1 ]; then
  section "dry run (no GPU needed): budget $BUDGET s = setup $T_SETUP + wheels $T_WHEELS + build $T_BUILD + info $T_INFO + tests $T_TESTS + sweep $T_SWEEP + netpath $T_NETPATH"
  [ $BUDGET -le 540 ] || { note "budget $BUDGET s is over 540 s"; status=1; }
  ( nvshmem_env; mps_env; test_env reduced; env | grep -E '^(NVSHMEM_|CUDA_MPS_|NVRAR_GPU_)' | sort ) \
    || { note "environment functions failed"; status=1; }
  ( netpath_env /tmp/ucx; env | grep -E '^(NVSHMEM_REMOTE|NVSHMEM_DISABLE_P2P|UCX_)' | sort ) \
    || { note "netpath environment failed"; status=1; }
  # The build: reuse the installed one; build in place only where nvcc is present and none is.
  if "$PY" -c "import nvrar, sys; i = nvrar.build_info(); print('installed build:', i); sys.exit(0 if i['cuda'] else 1)"; then
    note "build: reused the installed GPU executor"
  elif command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
    run_step build "$T_BUILD" build && note "build: OK" || { note "build: FAILED"; status=1; }
  else
    note "build: no nvcc here, not checked"
  fi
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    run_step wheels 60 wheels_check "$WHEELS" && note "wheels: install offline for Python 3.12 ($WHEELS)" \
      || { note "wheels: FAILED the offline install check ($WHEELS)"; status=1; }
  else
    note "wheels: none carried in $WHEELS (scripts/fetch_gpu_wheels.sh fetches them), not checked"
  fi
  run_step collect 60 "$PY" -m pytest tests/gpu --collect-only -q -p no:cacheprovider \
    && note "tests/gpu: collected" || { note "tests/gpu: collection FAILED"; status=1; }
  run_step sweep-args 30 sweep_args_check "${SWEEP_ARGS[@]}" && note "sweep arguments: OK" || { note "sweep arguments: FAILED"; status=1; }
  bash -n "$0" && note "script syntax: OK" || { note "script syntax: FAILED"; status=1; }
  exit $status
fi

# --- the check ------------------------------------------------------------------------------------
section "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv || true
echo "cores $(nproc); $("$PY" --version)"
"$PY" - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("nvidia-nvshmem-cu13", "nvidia-nccl-cu13", "cupy-cuda13x", "pytest-timeout", "pybind11", "setuptools",
             "nvshmem4py-cu13", "cuda-core", "cuda-bindings", "cuda-pathfinder"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
PY

section "MPS (started first, proved)"
mps_t0=$(date +%s)
if mps_start; then
  note "MPS: running, server answered, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per PE"
else
  [ $MPS -eq 1 ] && mps_stop
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  note "MPS: NOT available: PEs time-slice the GPU; tests run a minimal set at minimal load, NVSHMEM's reduce is skipped in the sweep"
fi
echo "[setup: $(($(date +%s) - mps_t0)) s]"

section "wheels (nvshmem4py, offline from $WHEELS)"
if ls "$WHEELS"/nvshmem4py_cu13-*.whl >/dev/null 2>&1; then
  run_step wheels "$T_WHEELS" wheels_install "$WHEELS" && note "wheels: nvshmem4py installed" \
    || { note "wheels: nvshmem4py did NOT install (its GPU tests fail)"; status=1; }
else
  note "wheels: no nvshmem4py wheel carried in $WHEELS (scripts/fetch_gpu_wheels.sh): its GPU tests fail"
  status=1
fi

section "build (sm_${NVRAR_CUDA_ARCHS:-90}, $(nproc) parallel jobs)"
if run_step build "$T_BUILD" build; then
  note "build: OK ($(grep -o 'nvcc: .*' build/nvrar-cuda-build.log | tail -1))"
else
  note "build: FAILED (gpu_build.log)"
  status=1
  exit 1
fi

section "info"
nvshmem_env
env | grep -E '^(NVSHMEM_|CUDA_MPS_)' | sort
run_step info "$T_INFO" "$PY" -c "import nvrar, json; i = nvrar.build_info(); print(json.dumps(i)); \
assert i['cuda'] and i['gpus'], i['cuda_error']; assert i['nvshmem_version'] == i['nvshmem_library_version'], i" \
  && note "info: GPU executor loads, NVSHMEM headers = library" || { note "info: FAILED"; status=1; }

section "GPU tests"
if [ $MPS -eq 1 ]; then
  test_env reduced
  sel=()
else
  test_env minimal
  sel=(-k "W2G1 or W4G2 or graph or timeout or nvshmem4py")
  echo "without MPS: only $(printf '%s ' "${sel[@]}")"
fi
run_step tests "$T_TESTS" "$PY" -m pytest tests/gpu -v -rA --maxfail=3 -p no:cacheprovider --timeout="$PER_TEST_TIMEOUT" \
  --junitxml="$OUTDIR/gpu_pytest.xml" "${sel[@]}" \
  && note "tests: PASSED (load $NVRAR_GPU_TEST_LOAD)" || { note "tests: FAILED (load $NVRAR_GPU_TEST_LOAD)"; status=1; }

section "latency sweep: 4 ranks, 2 per node"
backends=nvrar,nccl,nvshmem
[ $MPS -eq 1 ] || backends=nvrar,nccl  # NVSHMEM's collectives need MPS with several PEs per GPU
sweep_args $backends
run_step sweep "$T_SWEEP" "$PY" -m nvrar.bench "${SWEEP_ARGS[@]}" \
  && note "sweep: done ($backends) -> gpu_sweep.json" || { note "sweep: FAILED"; status=1; }

section "network path (NVSHMEM host proxy, P2P off)"
whl=$(ls "$ROOT"/.whl/libucx_cu13-*.whl 2>/dev/null | head -1)
if [ "$NETPATH" = off ]; then
  note "netpath: skipped (--no-netpath)"
elif [ -z "$whl" ]; then
  note "netpath: skipped (no .whl/libucx_cu13-*.whl carried; docs/gpu/README.md says how)"
else
  export whl
  netpath() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/nvrar-ucx "$whl" || return 1
    netpath_env /tmp/nvrar-ucx
    export NVRAR_GPU_NETPATH=1 NVRAR_GPU_REQUIRED=1 NVSHMEM_DEBUG=${NVSHMEM_DEBUG:-WARN}
    env | grep -E '^(NVSHMEM_|UCX_)' | sort
    "$PY" -m pytest tests/gpu -v -rA -x -p no:cacheprovider --timeout=$((T_NETPATH - 5)) -k "netpath"
  }
  export -f netpath
  run_step netpath "$T_NETPATH" netpath \
    && note "netpath: PASSED (UCX over TCP, P2P off)" || { note "netpath: FAILED (see its section; optional)"; }
fi
exit $status
