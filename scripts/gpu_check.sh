#!/usr/bin/env bash
# The one-GPU check of the GPU executor: one device call (at most 540 s of wall time on a fresh
# one-H200 machine with no network) gives a complete verdict, located even where something hangs.
#
#   scripts/gpu_check.sh            the check; everything lands in $OUT (or ./gpu_check-out)
#   scripts/gpu_check.sh --dry-run  what can be checked without a GPU (CI runs it): the deadlines'
#                                   order, the steps' sum, the environment functions, the build plan
#                                   (no compile), the tests' order and NVSHMEM init modes, collection
#                                   of tests/gpu, the sweep's arguments, the verdict parser on
#                                   tests/data/gpu_check-sample.log; ends with
#                                   "gpu_check dry-run: budget N s"
#   options: --no-netpath (skip the network-path step), --out DIR
#
# Steps, in order, each under its own deadline (their sum is the budget; a step never runs past the
# time left, and a step that overruns is stopped, SIGTERM then SIGKILL, with its process group):
#   setup        machine, package versions (every command under a deadline), MPS started first
#                and proved (control daemon with pipe/log dirs under /tmp, a tiny CUDA client, the
#                server list, the compute mode); CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / (most PEs
#                sharing the GPU), so that NVSHMEM leaves its limited multi-process-per-GPU mode
#   wheels       nvshmem4py and what it needs that the machine lacks, installed offline from the
#                wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh)
#   build-smoke  the module with the smoke step's kernel instances only (NVRAR_CUDA_UNITS=smoke: 5
#                of the 18 nvcc units, float32 and bfloat16 sum), sm_90, in place; at the same time,
#                in the background, build-rest compiles the other 15 units on the other cores
#                (NVRAR_CUDA_UNITS=rest, no link). No pip, no network: the pybind11, setuptools and
#                nvidia-nvshmem-cu13 installed there, so headers and library match
#   info         nvrar.build_info() and NVSHMEM's view of the PEs
#   smoke        tests/gpu/test_gpu_smoke.py, --maxfail=1, NVSHMEM_DEBUG=INFO: W2G1 and W4G2, one
#                float32 call of each protocol path, nvrar's own NVSHMEM init (build-rest goes on)
#   build-all    waits for build-rest, then links the full module (NVRAR_CUDA_UNITS=all: nothing
#                left to compile)
#   tests        test_gpu.py (NVRAR_NVSHMEM_INIT=nvrar), then test_gpu_nvshmem4py.py (through
#                nvshmem4py); NVSHMEM_DEBUG=WARN, reduced load (minimal without MPS)
#   sweep        latency 8 KB - 1 MB, 4 ranks, 2 per node: nvrar vs NCCL vs NVSHMEM's reduce -> JSON
#   netpath      optional (needs .whl/libucx_cu13-*.whl carried): 2 PEs, ranks_per_node=1,
#                NVSHMEM_DISABLE_P2P=1, NVSHMEM_REMOTE_TRANSPORT=ucx over TCP on loopback
#   mps-stop     MPS quit and its logs appended (in the EXIT trap, inside the budget)
# Deadlines of a GPU test, in order: the device deadline of its communicators
# (NVRAR_GPU_TEST_TIMEOUT) < the launcher's (NVRAR_GPU_LAUNCH_TIMEOUT: SIGTERM, every rank's Python
# stacks, SIGKILL after a grace) < pytest-timeout < the step's: a hang is reported by the kernel
# first, then by the ranks' stacks, never by a silent kill.
# Files under $OUT (at most 8): gpu_check.log (everything; its verdict lines are what
# scripts/gpu_verdict.py reads), gpu_build.log (the three builds' logs, a line per nvcc unit with its
# seconds), gpu_smoke.xml, gpu_pytest.xml, gpu_sweep.json. docs/gpu/README.md says where a run's
# files are committed (docs/gpu/logs/DATE-HOST/).
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
    -h|--help) sed -n '2,49p' "$0"; exit 0 ;;
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

# Step deadlines (seconds), in the order the steps run. Their sum is the budget; a step stopped at
# its deadline may overrun it by its kill grace (3 s) and the poll (1 s), so the budget stays
# MARGIN below the 540 s a device command is given.
STEP_NAMES=(setup wheels build-smoke info smoke build-all tests sweep netpath mps-stop)
declare -A DEADLINE=([setup]=30 [wheels]=25 [build-smoke]=110 [info]=10 [smoke]=60 [build-all]=55
                     [tests]=160 [sweep]=25 [netpath]=45 [mps-stop]=10)
MARGIN=10
BUDGET=0
for s in "${STEP_NAMES[@]}"; do BUDGET=$((BUDGET + DEADLINE[$s])); done
# The deadlines of one GPU test, in order (the dry run proves it): device < launcher (+ its kill
# grace, tests/_launch.py's KILL_GRACE_S) < pytest-timeout < the smoke step's.
TEST_TIMEOUT=15          # NVRAR_GPU_TEST_TIMEOUT: the communicators' device deadline (tests/_gpu_tasks.py)
LAUNCH_TIMEOUT=45        # NVRAR_GPU_LAUNCH_TIMEOUT: tests/_launch.py stops the ranks still running
PER_TEST_TIMEOUT=55      # pytest-timeout, per test
NETPATH_LAUNCH_TIMEOUT=$((DEADLINE[netpath] - 15)) NETPATH_PER_TEST_TIMEOUT=$((DEADLINE[netpath] - 5))
MAX_PES=4                # most PEs sharing the GPU in any step (tests and sweep)
SMOKE_JOBS=5             # nvcc processes of build-smoke (its 5 units at once); build-rest gets the other cores
WHEELS=$ROOT/.whl         # carried wheels (scripts/fetch_gpu_wheels.sh): nvshmem4py and its stack, libucx
SMOKE_TESTS=(tests/gpu/test_gpu_smoke.py)
GPU_TESTS=(tests/gpu/test_gpu.py tests/gpu/test_gpu_nvshmem4py.py)
START=$(date +%s)
PY=${PYTHON:-python3}
STEPS=$(mktemp /tmp/gpu_check-steps.XXXXXX)   # one line per step that ended: NAME STATUS RC ELAPSED DEADLINE
PGDIR=$(mktemp -d /tmp/gpu_check-pg.XXXXXX)   # the process group of each running step
SECTION_END=$((START + BUDGET))                # bounded's limit; each section sets its own
sweep_args() {  # $1: the backends
  SWEEP_ARGS=(--device cuda --launcher local --ranks 4 --ranks-per-node 2 --min-bytes 8K --max-bytes 1M
              --iters 40 --warmup 5 --backends "$1" --buffers ordinary,symmetric --json "$OUTDIR/gpu_sweep.json")
}
sweep_args nvrar,nccl,nvshmem
pytest_args() {  # $1: pytest-timeout per test
  PYTEST=(-m pytest -v -rA -p no:cacheprovider --capture=sys --durations=0 --timeout="$1")
}
pytest_args "$PER_TEST_TIMEOUT"

# Everything into the log file (written by each process directly: nothing left in a pipe when
# the command ends); the original stdout gets the log's tail at the end.
exec 3>&1
exec >>"$LOG" 2>&1
status=0
MPS=0
verdict=()
now() { date +%s; }
section() { echo; echo "=== $* (t=$(($(now) - START)) s, $(date +%T))"; }
note() { verdict+=("$*"); echo ">> $*"; }
record() {  # NAME STATUS RC ELAPSED DEADLINE: one step's outcome, for the verdict
  echo "$1 $2 $3 $4 $5" >>"$STEPS"
  echo "step-end: $1 $2 rc=$3 elapsed=$4 deadline=$5"
}
left() { echo $((START + BUDGET - DEADLINE[mps-stop] - $(now))); }  # seconds left to the steps

# bounded SECONDS CMD...: CMD (an external command) under `timeout`, within what is left of the
# current section (SECTION_END) and of the budget.
bounded() {
  local limit=$1 l
  shift
  l=$((SECTION_END - $(now)))
  [ "$l" -lt "$limit" ] && limit=$l
  [ "$limit" -lt 1 ] && limit=1
  timeout -k 2 "$limit" "$@"
}

kill_steps() {  # every step still running in the background, with its process group
  local f pg
  for f in "$PGDIR"/*; do
    [ -f "$f" ] || continue
    pg=$(cat "$f")
    kill -TERM -- "-$pg" 2>/dev/null && { sleep 2; kill -KILL -- "-$pg" 2>/dev/null; }
    rm -f "$f"
  done
}

finish() {
  local rc=$?
  trap - EXIT INT TERM
  kill_steps
  if [ $MPS -eq 1 ]; then
    local t0
    t0=$(now)
    mps_stop
    record mps-stop ok 0 $(($(now) - t0)) "${DEADLINE[mps-stop]}"
  fi
  # The three builds' logs (setup.py: a line "unit NAME: S s, exit RC" per nvcc unit) in one file.
  local b
  for b in smoke rest all; do
    f=$ROOT/build/nvrar-cuda-build-$b.log
    [ $b = all ] && f=$ROOT/build/nvrar-cuda-build.log
    [ -f "$f" ] && [ "$(stat -c %Y "$f")" -ge "$START" ] && { echo "##### NVRAR_CUDA_UNITS=$b: $f"; cat "$f"; }
  done >"$OUTDIR/gpu_build.log" 2>/dev/null
  [ -s "$OUTDIR/gpu_build.log" ] || rm -f "$OUTDIR/gpu_build.log"
  section "verdict"
  while read -r name st src el lim; do
    echo "verdict: step $name $st rc=$src elapsed=$el deadline=$lim"
  done <"$STEPS"
  if [ -f "$OUTDIR/gpu_build.log" ]; then
    awk '/^##### NVRAR_CUDA_UNITS=/ {split($2, a, "="); set = a[2]; sub(":", "", set)}
         /^unit / {name = $2; sub(":", "", name); rc = $6; printf "verdict: unit %s set=%s seconds=%s rc=%s\n", name, set, $3, rc}' \
      "$OUTDIR/gpu_build.log"
  fi
  for v in "${verdict[@]}"; do echo "verdict: note $v"; done
  rm -rf "$STEPS" "$PGDIR"
  echo "gpu_check: status $status, $(($(now) - START)) s of a $BUDGET s budget"
  if [ $DRY -eq 1 ]; then echo "gpu_check dry-run: budget $BUDGET s"; fi
  sync
  tail -n 200 "$LOG" >&3
  [ $status -eq 0 ] && exit "$rc" || exit 1
}
trap finish EXIT
trap 'echo "!! gpu_check: interrupted"; status=1; exit 1' INT TERM

# run_step NAME SECONDS CMD...: CMD in its own process group, stopped (TERM, then KILL 3 s later) at
# its deadline or when the budget runs out, whichever comes first; its outcome recorded.
run_step() {
  local name=$1 limit=$2 want=$2
  shift 2
  local l
  l=$(left)
  [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -le 0 ]; then
    record "$name" skipped - 0 "$want"
    note "$name: SKIPPED, no time left"
    return 124
  fi
  echo "+ [$name, deadline ${limit} s] $*"
  local t0 stopped=0
  t0=$(now)
  setsid bash -c '"$@"' run_step "$@" &  # a new process group; shell functions are exported
  local pid=$!
  echo "$pid" >"$PGDIR/$name"
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(($(now) - t0)) -ge "$limit" ]; then
      echo "!! $name: deadline ${limit} s passed: stopping its process group $pid (SIGTERM, SIGKILL 3 s later)"
      kill -TERM -- "-$pid" 2>/dev/null
      sleep 3
      kill -KILL -- "-$pid" 2>/dev/null
      stopped=1
      break
    fi
    sleep 1
  done
  wait "$pid"
  local rc=$?
  rm -f "$PGDIR/$name"
  local st=ok
  [ $rc -ne 0 ] && st=failed
  [ $stopped -eq 1 ] && st=timeout
  echo "[$name: exit $rc after $(($(now) - t0)) s]"
  record "$name" $st $rc $(($(now) - t0)) "$limit"
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
  export NVRAR_GPU_TEST_LOAD=$1 NVRAR_GPU_TEST_TIMEOUT=$TEST_TIMEOUT NVRAR_GPU_LAUNCH_TIMEOUT=$LAUNCH_TIMEOUT
  export NVRAR_GPU_REQUIRED=1 NVSHMEM_DEBUG=${NVSHMEM_DEBUG:-WARN}
}

smoke_env() {  # the smoke step: NVSHMEM's whole account of its init (test_env first)
  export NVSHMEM_DEBUG=INFO NVRAR_NVSHMEM_INIT=nvrar
}

netpath_env() {  # $1: directory of the unpacked libucx wheel
  export LD_LIBRARY_PATH=$1/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export NVSHMEM_REMOTE_TRANSPORT=ucx NVSHMEM_DISABLE_P2P=1
  export UCX_TLS=tcp,cuda_copy,self UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
  export NVRAR_GPU_TEST_LOAD=minimal NVRAR_GPU_LAUNCH_TIMEOUT=$NETPATH_LAUNCH_TIMEOUT
}

compute_mode() { bounded 10 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>&1 | head -1; }

mps_start() {
  mps_env
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  echo "compute mode: $(compute_mode)"
  command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control"; return 1; }
  bounded 10 nvidia-cuda-mps-control -d || { echo "nvidia-cuda-mps-control -d failed or timed out"; return 1; }
  MPS=1
  # Proof: a tiny client must get a context through the server, and the server must be listed.
  bounded 20 "$PY" -c "import torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); \
print('MPS client: sum', float(x.sum()), 'with', __import__('os').environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'], '% threads')" \
    || { echo "MPS client failed or timed out"; return 1; }
  local servers
  servers=$(echo get_server_list | bounded 5 nvidia-cuda-mps-control 2>&1)
  echo "MPS servers: ${servers:-none}"
  [ -n "$servers" ] && [[ "$servers" =~ ^[0-9] ]] || { echo "no MPS server answered"; return 1; }
  echo "compute mode with MPS: $(compute_mode)"
}

mps_stop() {  # within DEADLINE[mps-stop]: quit (5 s), a second for the server to go, the logs
  echo quit | timeout -k 1 5 nvidia-cuda-mps-control 2>&1 || true
  sleep 1
  section "MPS log"
  timeout 2 cat "${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvrar-mps/log}"/control.log \
    "${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvrar-mps/log}"/server.log 2>/dev/null | tail -n 60
  MPS=0
}

build() {  # $1: NVRAR_CUDA_UNITS (smoke, rest, all), $2: nvcc processes at once; the GPU executor in place, sm_90
  export NVRAR_CUDA=1 NVRAR_CUDA_ARCHS=${NVRAR_CUDA_ARCHS:-90} NVRAR_CUDA_UNITS=$1 NVRAR_BUILD_JOBS=$2
  "$PY" setup.py -q build_ext --inplace
}

# The carried wheels, checked for the GPU machine (Python 3.12, linux x86_64) without installing:
# every wheel's tags fit it, every requirement of nvshmem4py's closure is carried or on the machine
# already (numpy, nvidia-nvshmem-cu13), all of it fits the 64 MiB a device call carries, and pip
# itself installs them from the folder alone (--no-index --dry-run for that interpreter).
wheels_check() {  # $1: the folder
  "$PY" - "$1" <<'PY' || return 1
import email.parser, os, re, subprocess, sys, zipfile
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
# What travels with them: the working tree (tracked files and untracked ones git does not ignore).
try:
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    tree = sum(os.path.getsize(n) for n in names if n and os.path.isfile(n))
except (OSError, subprocess.CalledProcessError):
    tree = 0
    print("wheels: the working tree's size is unknown here (no git): only the wheels are counted")
if total + tree > 64 * 2**20:
    bad.append(f"{total} bytes of wheels and {tree} of working tree are over the 64 MiB a device call carries "
               "(leave libucx out: the network-path step is optional)")
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
  # nvshmem4py alone: nvrar is not built yet at this step (its import needs the module)
  "$PY" -c "import importlib.metadata as m, nvshmem.core; print('nvshmem4py', m.version('nvshmem4py-cu13'), 'imports')"
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


# --- what the dry run proves (the check prints the same lines) -------------------------------------

plan_line() {
  local s line="gpu_check plan:"
  for s in "${STEP_NAMES[@]}"; do line+=" $s=${DEADLINE[$s]}"; done
  echo "$line budget=$BUDGET"
}

# The deadlines of a GPU test in order, from the environment test_env and netpath_env export and the
# pytest arguments the steps pass; the steps' deadlines sum to the budget, which stays under 540 s.
deadlines_check() {
  local grace pt bad=0 sum=0 s
  grace=$(sed -n 's/^KILL_GRACE_S = \([0-9]*\).*/\1/p' tests/_launch.py)
  pt=$(printf '%s\n' "${PYTEST[@]}" | sed -n 's/^--timeout=//p')
  ( test_env reduced
    echo "gpu_check deadlines: device $NVRAR_GPU_TEST_TIMEOUT s < launcher $NVRAR_GPU_LAUNCH_TIMEOUT s + grace ${grace:-?} s" \
      "< pytest-timeout $pt s < smoke step ${DEADLINE[smoke]} s, tests step ${DEADLINE[tests]} s"
    [ "$NVRAR_GPU_TEST_TIMEOUT" -lt "$NVRAR_GPU_LAUNCH_TIMEOUT" ] && [ -n "$grace" ] \
      && [ $((NVRAR_GPU_LAUNCH_TIMEOUT + grace)) -lt "$pt" ] && [ "$pt" -lt "${DEADLINE[smoke]}" ] \
      && [ "$pt" -lt "${DEADLINE[tests]}" ] ) || bad=1
  ( test_env reduced; netpath_env /tmp/ucx
    echo "gpu_check netpath deadlines: device $NVRAR_GPU_TEST_TIMEOUT s < launcher $NVRAR_GPU_LAUNCH_TIMEOUT s + grace" \
      "${grace:-?} s < pytest-timeout $NETPATH_PER_TEST_TIMEOUT s < netpath step ${DEADLINE[netpath]} s"
    [ "$NVRAR_GPU_TEST_TIMEOUT" -lt "$NVRAR_GPU_LAUNCH_TIMEOUT" ] \
      && [ $((NVRAR_GPU_LAUNCH_TIMEOUT + grace)) -lt "$NETPATH_PER_TEST_TIMEOUT" ] \
      && [ "$NETPATH_PER_TEST_TIMEOUT" -lt "${DEADLINE[netpath]}" ] ) || bad=1
  for s in "${STEP_NAMES[@]}"; do sum=$((sum + DEADLINE[$s])); done
  echo "gpu_check steps: sum $sum s = budget $BUDGET s; + margin $MARGIN s <= 540 s"
  [ "$sum" -eq "$BUDGET" ] && [ $((BUDGET + MARGIN)) -le 540 ] || bad=1
  return $bad
}

# The nvcc units setup.py compiles for each NVRAR_CUDA_UNITS, read from setup.py itself (nothing
# compiled): "smoke" and "rest" together cover "all", so that "all" after them only links.
build_plan_check() {
  "$PY" - <<'PY'
import glob, sys, types, setuptools
setuptools.setup = lambda **kw: None
try:
    import pybind11.setup_helpers  # noqa: F401
except ImportError:
    # A build requirement only: an environment that installed nvrar with build isolation (pip
    # install -e, as CI does) lacks it. The unit list needs none of it; stand-ins let setup.py load.
    class _Inert:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: None

    helpers = types.ModuleType("pybind11.setup_helpers")
    helpers.ParallelCompile = helpers.Pybind11Extension = _Inert
    helpers.build_ext = type("build_ext", (), {})
    pkg = types.ModuleType("pybind11")
    pkg.setup_helpers = helpers
    sys.modules.update({"pybind11": pkg, "pybind11.setup_helpers": helpers})
g = {"__name__": "nvrar_setup_probe", "__file__": "setup.py"}
exec(compile(open("setup.py").read(), "setup.py", "exec"), g)
sources = sorted(glob.glob("csrc/cuda/*.cu"))
units = {}
for mode in ("all", "smoke", "rest"):
    g["CUDA_UNITS"] = mode
    units[mode] = [obj.rsplit("/", 1)[-1] for _src, _defs, obj in g["BuildExt"].units(sources, "tmp")]
left = sorted(set(units["all"]) - set(units["smoke"]) - set(units["rest"]))
print(f"gpu_check build plan: all {len(units['all'])} nvcc units, smoke {len(units['smoke'])}, rest "
      f"{len(units['rest'])}; left to all after smoke and rest: {len(left)} {left if left else ''}")
print("  smoke:", " ".join(units["smoke"]))
sys.exit(1 if left or not units["smoke"] else 0)
PY
}

# How each GPU test initializes NVSHMEM: every test function of tests/gpu called with launch()
# replaced by a recorder (nothing launched); test_gpu.py and test_gpu_smoke.py must ask for nvrar's
# own init, test_gpu_nvshmem4py.py for nvshmem4py's.
init_split_check() {
  "$PY" - <<'PY'
import importlib, inspect, os, sys, types
sys.path[:0] = ["tests", "tests/gpu"]
sys.modules.setdefault("cupy", types.ModuleType("cupy"))  # importorskip("cupy") passes: nothing runs
os.environ.update(NVSHMEM_DISABLE_P2P="1", NVSHMEM_REMOTE_TRANSPORT="ucx")  # the netpath test's own precondition
WANT = {"test_gpu": "nvrar", "test_gpu_smoke": "nvrar", "test_gpu_nvshmem4py": "nvshmem4py"}


class Launched(Exception):
    pass


bad, summary = [], []
for name, want in WANT.items():
    mod = importlib.import_module(name)
    seen = []

    def recorder(world, task, args=None, env=None, **kw):
        seen.append((env or {}).get("NVRAR_NVSHMEM_INIT", "unset"))
        raise Launched

    mod.launch = recorder
    tests = [f for n, f in vars(mod).items() if n.startswith("test_") and inspect.isfunction(f)
             and f.__module__ == name]
    for fn in tests:
        calls = [{}]
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "parametrize":
                names = [a.strip() for a in mark.args[0].split(",")]
                calls = [dict(zip(names, v if isinstance(v, tuple) else (v,))) for v in mark.args[1]]
        for kwargs in calls:
            before = len(seen)
            try:
                fn(**kwargs)
            except Launched:
                pass
            if len(seen) != before + 1 or seen[-1] != want:
                bad.append(f"{name}.{fn.__name__}{kwargs or ''}: NVRAR_NVSHMEM_INIT={seen[before:] or 'never launched'}, want {want}")
    summary.append(f"{name}.py: {len(seen)} launches, NVRAR_NVSHMEM_INIT={','.join(sorted(set(seen))) or '-'}")
print("gpu_check init split: " + "; ".join(summary))
for b in bad:
    print("gpu_check init split: WRONG", b)
sys.exit(1 if bad else 0)
PY
}

# The order the smoke and test steps run the tests in (pytest --collect-only of exactly their
# arguments): by what they tell, and no test file of tests/gpu left out of both.
test_order_check() {  # PYTEST ARGS... -- the smoke step's test files, then the test step's
  local out rc args=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
  shift
  out=$(mktemp /tmp/gpu_check-collect.XXXXXX)
  # the steps' own pytest arguments (--timeout included: pytest-timeout, or tests/gpu/conftest.py's stand-in)
  "$PY" "${args[@]}" --collect-only -q -q "$@" >"$out" 2>&1  # -v -q -q: one node id a line
  "$PY" - "$out" "$@" <<'PY'
import glob, re, sys
ORDER = [("smoke", r"test_gpu_smoke\.py::"), ("matrix", r"::test_gpu_matrix"), ("graph", r"::test_cuda_graph"),
         ("timeout", r"::test_timeout"), ("fused", r"::test_gpu_fused"), ("cupy", r"::test_cupy"),
         ("netpath", r"::test_netpath"), ("nvshmem4py", r"test_gpu_nvshmem4py\.py::")]
ids = [line.strip() for line in open(sys.argv[1]) if "::" in line]
seq, bad = [], []
for i in ids:
    k = next((n for n, (_, rx) in enumerate(ORDER) if re.search(rx, i)), None)
    if k is None:
        bad.append(f"{i}: in no category of the order")
    elif seq and k < seq[-1]:
        bad.append(f"{i} ({ORDER[k][0]}) runs after a {ORDER[seq[-1]][0]} test")
    if k is not None:
        seq.append(k)
files = set(sys.argv[2:])
left = sorted(f for f in glob.glob("tests/gpu/test_*.py") if f not in files)
bad += [f"{f}: run by neither the smoke nor the test step" for f in left]
counts = [f"{name}({seq.count(n)})" for n, (name, _) in enumerate(ORDER) if n in seq]
print("gpu_check test order:", " ".join(counts), f"({len(ids)} tests)")
for b in bad:
    print("gpu_check test order: WRONG", b)
if not ids:
    print(open(sys.argv[1]).read()[-3000:])
sys.exit(1 if bad or not ids else 0)
PY
  rc=$?
  rm -f "$out"
  return $rc
}

export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PY ROOT
export -f build sweep_args_check nvshmem_env netpath_env wheels_check wheels_install build_plan_check \
  init_split_check test_order_check

plan_line

# --- dry run ------------------------------------------------------------------------------------
if [ $DRY -eq 1 ]; then
  section "dry run (no GPU needed): budget $BUDGET s"
  deadlines_check && note "deadlines: in order, steps sum to the budget" \
    || { note "deadlines: OUT OF ORDER (see the gpu_check deadlines lines)"; status=1; }
  ( nvshmem_env; mps_env; test_env reduced; smoke_env; env | grep -E '^(NVSHMEM_|CUDA_MPS_|NVRAR_GPU_|NVRAR_NVSHMEM)' | sort ) \
    || { note "environment functions failed"; status=1; }
  ( test_env reduced; netpath_env /tmp/ucx; env | grep -E '^(NVSHMEM_REMOTE|NVSHMEM_DISABLE_P2P|UCX_|NVRAR_GPU_LAUNCH)' | sort ) \
    || { note "netpath environment failed"; status=1; }
  run_step build-plan 30 build_plan_check && note "build plan: smoke and rest cover all" \
    || { note "build plan: FAILED"; status=1; }
  # The build: the installed one reused; none is compiled here (minutes of nvcc: pip install builds it).
  if "$PY" -c "import nvrar, sys; i = nvrar.build_info(); print('installed build:', i); sys.exit(0 if i['cuda'] else 1)"; then
    note "build: reused the installed GPU executor"
  elif command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
    note "build: nvcc is here but no GPU executor is installed; the dry run compiles none (pip install -e . does)"
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
  run_step test-order 60 test_order_check "${PYTEST[@]}" -- "${SMOKE_TESTS[@]}" "${GPU_TESTS[@]}" && note "test order: smoke, matrix, graph, timeout, fused, nvshmem4py" \
    || { note "test order: FAILED"; status=1; }
  run_step init-split 60 init_split_check \
    && note "init split: test_gpu.py and the smoke under nvrar, test_gpu_nvshmem4py.py under nvshmem4py" \
    || { note "init split: FAILED"; status=1; }
  run_step sweep-args 30 sweep_args_check "${SWEEP_ARGS[@]}" && note "sweep arguments: OK" || { note "sweep arguments: FAILED"; status=1; }
  run_step verdict-parse 30 "$PY" scripts/gpu_verdict.py tests/data/gpu_check-sample.log \
    && note "verdict parser: reads tests/data/gpu_check-sample.log" || { note "verdict parser: FAILED"; status=1; }
  bash -n "$0" && note "script syntax: OK" || { note "script syntax: FAILED"; status=1; }
  exit $status
fi

# --- the check ------------------------------------------------------------------------------------
section "setup: machine, packages, MPS (started first, proved)"
setup_t0=$(now)
SECTION_END=$((setup_t0 + DEADLINE[setup]))
bounded 10 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv || echo "(nvidia-smi: exit $?)"
echo "cores $(nproc); $("$PY" --version)"
bounded 20 "$PY" - <<'PY' || echo "(versions: exit $?)"
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
if bounded 10 "$PY" -c "import pytest_timeout"; then
  note "pytest-timeout: installed (--timeout=$PER_TEST_TIMEOUT per test)"
else
  note "pytest-timeout: NOT installed: tests/gpu/conftest.py's stand-in enforces --timeout=$PER_TEST_TIMEOUT per test"
fi
if mps_start; then
  note "MPS: running, server answered, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per PE"
  record setup ok 0 $(($(now) - setup_t0)) "${DEADLINE[setup]}"
else
  [ $MPS -eq 1 ] && mps_stop
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  note "MPS: NOT available: several PEs on this GPU run in NVSHMEM's limited multi-process-per-GPU mode, which nvrar refuses at set-up (its collectives are not allowed there): expect every GPU test to fail with that error; a minimal set runs at minimal load"
  record setup failed 1 $(($(now) - setup_t0)) "${DEADLINE[setup]}"
fi

section "wheels (nvshmem4py, offline from $WHEELS)"
if ls "$WHEELS"/nvshmem4py_cu13-*.whl >/dev/null 2>&1; then
  run_step wheels "${DEADLINE[wheels]}" wheels_install "$WHEELS" && note "wheels: nvshmem4py installed" \
    || { note "wheels: nvshmem4py did NOT install (its GPU tests fail)"; status=1; }
else
  record wheels skipped - 0 "${DEADLINE[wheels]}"
  note "wheels: no nvshmem4py wheel carried in $WHEELS (scripts/fetch_gpu_wheels.sh): its GPU tests fail"
  status=1
fi

section "build-smoke (NVRAR_CUDA_UNITS=smoke, $SMOKE_JOBS jobs), build-rest beside it ($(( $(nproc) > SMOKE_JOBS ? $(nproc) - SMOKE_JOBS : 1 )) jobs)"
# build-rest runs until the link window's last 30 s (the link's share), its output kept apart.
REST_OUT=$(mktemp /tmp/gpu_check-rest.XXXXXX)
rest_limit=$((DEADLINE[build-smoke] + DEADLINE[info] + DEADLINE[smoke] + DEADLINE[build-all] - 30))
run_step build-rest "$rest_limit" build rest $(( $(nproc) > SMOKE_JOBS ? $(nproc) - SMOKE_JOBS : 1 )) >"$REST_OUT" 2>&1 &
REST_PID=$!
SMOKE_BUILT=0
if run_step build-smoke "${DEADLINE[build-smoke]}" build smoke "$SMOKE_JOBS"; then
  SMOKE_BUILT=1
  note "build-smoke: OK ($(grep -o 'nvcc: .*' build/nvrar-cuda-build-smoke.log | tail -1))"
else
  note "build-smoke: FAILED (gpu_build.log)"
  status=1
fi

nvshmem_env
if [ $MPS -eq 1 ]; then test_env reduced; else test_env minimal; fi
section "info"
env | grep -E '^(NVSHMEM_|CUDA_MPS_|NVRAR_GPU_)' | sort
deadlines_check || { note "deadlines: OUT OF ORDER"; status=1; }
if [ $SMOKE_BUILT -eq 1 ]; then
  run_step info "${DEADLINE[info]}" "$PY" -c "import nvrar, json; i = nvrar.build_info(); print(json.dumps(i)); \
assert i['cuda'] and i['gpus'], i['cuda_error']; assert i['nvshmem_version'] == i['nvshmem_library_version'], i" \
    && note "info: GPU executor loads, NVSHMEM headers = library" || { note "info: FAILED"; status=1; }

  section "smoke: W2G1 and W4G2, one float32 call per protocol path, nvrar's own NVSHMEM init"
  smoke() { smoke_env; env | grep -E '^(NVSHMEM_DEBUG|NVRAR_)' | sort; "$PY" "$@"; }
  export -f smoke smoke_env
  run_step smoke "${DEADLINE[smoke]}" smoke "${PYTEST[@]}" --maxfail=1 --junitxml="$OUTDIR/gpu_smoke.xml" "${SMOKE_TESTS[@]}" \
    && note "smoke: PASSED" || { note "smoke: FAILED (its section: progress lines, stacks, NVSHMEM INFO)"; status=1; }
else
  record info skipped - 0 "${DEADLINE[info]}"
  record smoke skipped - 0 "${DEADLINE[smoke]}"
fi

section "build-all: build-rest's end, then the full module linked (NVRAR_CUDA_UNITS=all)"
link_t0=$(now)
# build-rest gets until the last 30 s of this window (the link's share); still compiling then, it is
# stopped, and the link compiles what is left with every core.
while kill -0 "$REST_PID" 2>/dev/null && [ $(($(now) - link_t0)) -lt $((DEADLINE[build-all] - 30)) ]; do sleep 1; done
if kill -0 "$REST_PID" 2>/dev/null; then
  note "build-rest: still compiling $((DEADLINE[build-all] - 30)) s into build-all's window: stopped, build-all compiles the rest"
  [ -f "$PGDIR/build-rest" ] && kill -TERM -- "-$(cat "$PGDIR/build-rest")" 2>/dev/null
fi
wait "$REST_PID"
rest_rc=$?
cat "$REST_OUT"
rm -f "$REST_OUT"
[ $rest_rc -eq 0 ] && note "build-rest: OK ($(grep -o 'nvcc: .*' build/nvrar-cuda-build-rest.log | tail -1))" \
  || note "build-rest: FAILED (exit $rest_rc; gpu_build.log)"
if run_step build-all $((DEADLINE[build-all] - ($(now) - link_t0))) build all "$(nproc)"; then
  note "build-all: OK ($(grep -o 'nvcc: .*' build/nvrar-cuda-build.log | tail -1))"
else
  note "build-all: FAILED (gpu_build.log): no test step"
  status=1
  for s in tests sweep netpath; do record "$s" skipped - 0 "${DEADLINE[$s]}"; done
  exit 1
fi

section "tests: test_gpu.py (NVRAR_NVSHMEM_INIT=nvrar), test_gpu_nvshmem4py.py (through nvshmem4py)"
sel=()
if [ $MPS -ne 1 ]; then
  sel=(-k "W2G1 or W4G2 or graph or timeout or nvshmem4py")
  echo "without MPS: only $(printf '%s ' "${sel[@]}")"
fi
run_step tests "${DEADLINE[tests]}" "$PY" "${PYTEST[@]}" --maxfail=3 --junitxml="$OUTDIR/gpu_pytest.xml" "${sel[@]}" \
  "${GPU_TESTS[@]}" \
  && note "tests: PASSED (load $NVRAR_GPU_TEST_LOAD)" || { note "tests: FAILED (load $NVRAR_GPU_TEST_LOAD)"; status=1; }

section "latency sweep: 4 ranks, 2 per node"
backends=nvrar,nccl,nvshmem
[ $MPS -eq 1 ] || backends=nvrar,nccl  # NVSHMEM's collectives need MPS with several PEs per GPU
sweep_args $backends
run_step sweep "${DEADLINE[sweep]}" "$PY" -m nvrar.bench "${SWEEP_ARGS[@]}" \
  && note "sweep: done ($backends) -> gpu_sweep.json" || { note "sweep: FAILED"; status=1; }

section "network path (NVSHMEM host proxy, P2P off)"
whl=$(ls "$ROOT"/.whl/libucx_cu13-*.whl 2>/dev/null | head -1)
if [ "$NETPATH" = off ]; then
  record netpath skipped - 0 "${DEADLINE[netpath]}"
  note "netpath: skipped (--no-netpath)"
elif [ -z "$whl" ]; then
  record netpath skipped - 0 "${DEADLINE[netpath]}"
  note "netpath: skipped (no .whl/libucx_cu13-*.whl carried; docs/gpu/README.md says how)"
else
  export whl NETPATH_PER_TEST_TIMEOUT NETPATH_LAUNCH_TIMEOUT
  pytest_args "$NETPATH_PER_TEST_TIMEOUT"
  netpath() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/nvrar-ucx "$whl" || return 1
    netpath_env /tmp/nvrar-ucx
    export NVRAR_GPU_NETPATH=1 NVRAR_GPU_REQUIRED=1
    env | grep -E '^(NVSHMEM_|UCX_|NVRAR_GPU_)' | sort
    "$PY" "$@" -x -k "netpath" tests/gpu/test_gpu.py
  }
  export -f netpath
  run_step netpath "${DEADLINE[netpath]}" netpath "${PYTEST[@]}" \
    && note "netpath: PASSED (UCX over TCP, P2P off)" || { note "netpath: FAILED (see its section; optional)"; }
fi
exit $status
