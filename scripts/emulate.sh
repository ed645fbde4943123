#!/usr/bin/env bash
# The GPU executor's device code on emulated PEs (csrc/emu, docs/gpu/emulation.md): builds the
# emulated device driver from csrc/ with the host compiler (no nvcc, no GPU) and runs the suite.
#
#   scripts/emulate.sh [--tsan] [--quick] [--waves] [--consistency] [--seed N] [--only SUBSTRING]...
#   scripts/emulate.sh --mutations [--seed N]
#   scripts/emulate.sh --coverage [--quick] [--seed N]
#   scripts/emulate.sh --host [--quick] [--tsan] [--seed N] [--only SUBSTRING]...
#   scripts/emulate.sh --host --coverage [--quick] [--seed N]
#   scripts/emulate.sh --ledger LAYOUT SIZE [--algorithm auto|one-shot|two-shot] [--dtype bfloat16|float32]
#                      [--threads N] [--seed N] [--channels C] [--ll-max-bytes SIZE]
#
# --tsan       build and run under ThreadSanitizer (fence model: csrc/emu/emu.cpp); a report fails
#              its case
# --quick      a smaller set of cases (every layout and path at least once)
# --waves      block waves: a launch that is not cooperative (one block per channel; the channel
#              count is 4 here) runs at most k of its blocks at once on each PE, 1 <= k < blocks
#              drawn per PE and call from the seed (one PE per call, in turn, k = 1), the next
#              block starting when one ends
# --consistency proxy-consistency mode (IBRC without gdrcopy): a write the proxy delivers (a put's
#              pieces, a signal, each on its own) becomes visible up to 300 us late, or at once at
#              the target's consistency point (nvshmem_uint64_wait_until)
# --seed N     the proxy's and the data's seed (default: from the clock; a failure prints its seed)
# --mutations  builds each mutant of the device code (a deliberate ordering or protocol bug, made
#              on a copy of the sources: the GPU build never sees one) and asserts that the suite
#              catches it; one line per mutation, exit 0 only if every one is caught
# --coverage   builds with gcov instrumentation, runs the suite and prints the line coverage of
#              device.cuh, allreduce_kernel.cuh and fused_kernel.cuh (the lines not run, listed)
# --host       the host half (docs/gpu/emulation.md, "Host half"): csrc/cuda/runtime.cu, allreduce.cu,
#              fused.cu and the 15 instance units, unmodified, compiled by the host compiler against
#              the emulated CUDA runtime and NVSHMEM host API (csrc/emu/host, host_emu.cpp), driven
#              through gpu::GpuExecutor by csrc/emu/host_driver.cpp; last line
#                emulated host: N cases passed, M failed (tsan: on|off)
#              with --coverage: built with gcov, prints the line coverage of runtime.cu and the
#              launch units (the lines not run, listed) and exits non-zero if a case failed
# --ledger     the wire ledger of ONE call (docs/gpu/emulation.md, "Wire ledger"): LAYOUT is NxG
#              (2x4), SIZE in bytes as nvrar writes sizes (128K, 2M); the call is planned with
#              nvrar.settings' GPU defaults (GPU_LAUNCH, one-shot and LL thresholds, max_bytes),
#              read here with python3; threads per block default to 32. The one mode whose stdout
#              is not the summary line: it prints exactly one JSON document (nvrar.wire-ledger/1),
#              the build's output goes to stderr; exit 0 only if the call ran and its result was
#              bitwise right; --channels and --ll-max-bytes replace those defaults (the candidates
#              that the model weighs against the defaults' choice: scripts/wire_candidates.sh)
# Otherwise: exit status 0 only if every case passes; the last line is
#   emulated device: N cases passed, M failed (tsan: on|off)
# Environment: CXX (default g++), NVRAR_BUILD_JOBS (parallel compiles, default 2), NVRAR_EMU_BUILD
# (build folder, default build/emu).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tsan=0 quick=0 waves=0 consistency=0 mutations=0 coverage=0 host=0 seed="" only=() ledger=() ledger_opts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tsan) tsan=1 ;;
    --quick) quick=1 ;;
    --waves) waves=1 ;;
    --consistency) consistency=1 ;;
    --mutations) mutations=1 ;;
    --coverage) coverage=1 ;;
    --host) host=1 ;;
    --seed) seed=${2:?--seed needs a number}; shift ;;
    --only) only+=(--only "${2:?--only needs a substring}"); shift ;;
    --ledger) ledger=("${2:?--ledger needs LAYOUT SIZE}" "${3:?--ledger needs LAYOUT SIZE}"); shift 2 ;;
    --algorithm|--dtype|--threads|--channels|--ll-max-bytes) ledger_opts+=("$1" "${2:?$1 needs a value}"); shift ;;
    -h|--help) sed -n '2,46p' "$0"; exit 0 ;;
    *) echo "emulate.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
cxx=${CXX:-g++}
jobs=${NVRAR_BUILD_JOBS:-2}
build=${NVRAR_EMU_BUILD:-$root/build/emu}
command -v "$cxx" >/dev/null || { echo "emulate.sh: no C++ compiler ($cxx)" >&2; exit 3; }
[ -n "$seed" ] || seed=$(( $(date +%s) % 1000000 ))

base_flags=(-std=c++20 -DNVRAR_EMULATE -ffp-contract=off -fno-strict-aliasing -pthread
            -Wall -Wextra -Wno-unused-parameter -Wno-unknown-pragmas -Werror)
plain_flags=(-O1)
tsan_flags=(-O1 -g -fsanitize=thread -Wno-tsan)  # fences: modelled by hand (NOTE [tsan fences])

# build DIR CSRC MINIMAL FLAGS...: the driver in DIR/emulate_driver.
build_driver() {
  local dir=$1 inc=$2 minimal=$3; shift 3
  mkdir -p "$dir"
  local extra=("$@") cmds=() types=(float f16 bf16 int32_t)
  [ "$minimal" = 1 ] && { extra+=(-DNVRAR_EMU_MINIMAL); types=(float); }
  for t in "${types[@]}"; do
    local int=0; [ "$t" = int32_t ] && int=1
    cmds+=("$dir/k_$t.o|$inc/emu/kernels_inst.cpp|-DNVRAR_INST_T=$t -DNVRAR_INST_INT=$int")
  done
  cmds+=("$dir/emu.o|$inc/emu/emu.cpp|" "$dir/driver.o|$inc/emu/driver.cpp|")
  printf '%s\n' "${cmds[@]}" | NVRAR_EMU_FLAGS="${extra[*]}" NVRAR_EMU_INC="$inc" NVRAR_EMU_KEEP="${NVRAR_EMU_KEEP:-}" xargs -P "$jobs" -I{} bash -c '
    IFS="|" read -r out src defs <<<"$1"
    # shellcheck disable=SC2086
    compile "$out" "$src" "$NVRAR_EMU_INC" $NVRAR_EMU_FLAGS $defs' _ {} ||
    return 1
  "$cxx" -pthread "${extra[@]}" "$dir"/*.o -o "$dir/emulate_driver"
}
base_flags_s="${base_flags[*]}"
export cxx base_flags_s
# compile OUT SRC CSRC_ROOT FLAGS...: one object, rebuilt when a source under CSRC_ROOT is newer.
compile() {
  local out=$1 src=$2 inc=$3; shift 3
  # NVRAR_EMU_KEEP: objects that do not include the device code, kept as they are (mutants).
  if [ -f "$out" ] && [[ " ${NVRAR_EMU_KEEP:-} " == *" $(basename "$out") "* ]]; then return 0; fi
  if [ -f "$out" ] && [ -z "$(find "$inc" "$src" -newer "$out" \( -name '*.h' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cu' \) -print -quit)" ]; then
    return 0
  fi
  # shellcheck disable=SC2086
  "$cxx" $base_flags_s "$@" -I"$inc" -c "$src" -o "$out.tmp" && mv "$out.tmp" "$out"
}
export -f compile

tsan_env() {
  # ThreadSanitizer: every report is counted by the driver (it fails the case), none halts the run.
  export TSAN_OPTIONS="halt_on_error=0 report_signal_unsafe=0 history_size=4 ${TSAN_OPTIONS:-}"
}

# coverage_report TOTAL FILE...: gcov's text (-t) on stdin, merged over objects by line: each FILE's
# lines run, those not run listed, and (TOTAL not empty) one line for all of them together.
coverage_report() {
  python3 -c '
import re, sys
label, files = sys.argv[1], tuple(sys.argv[2:])
cur, seen = None, {}
for line in sys.stdin:
    m = re.match(r"\s*-:\s*0:Source:(.*)$", line)
    if m:
        cur = next((f for f in files if m.group(1).endswith(f)), None)
        continue
    m = re.match(r"\s*([^:]+):\s*(\d+):(.*)$", line)
    if not m or cur is None:
        continue
    count, no, text = m.group(1).strip(), int(m.group(2)), m.group(3)
    if count == "-" or no == 0:
        continue
    ran = count not in ("#####", "=====")
    key = (cur, no)
    seen[key] = (seen.get(key, (False, text))[0] or ran, text)
tot_all = run_all = 0
for f in files:
    lines = sorted((no, v) for (g, no), v in seen.items() if g == f)
    run = sum(1 for _, (r, _) in lines if r)
    tot_all += len(lines); run_all += run
    print(f"coverage {f}: {run} of {len(lines)} lines ({100.0 * run / max(1, len(lines)):.1f}%)")
    for no, (r, text) in lines:
        if not r:
            print(f"  not run: {f}:{no}: {text.strip()}")
if label:
    print(f"coverage of {label}: {run_all} of {tot_all} lines ({100.0 * run_all / max(1, tot_all):.1f}%)")
' "$@"
}

# build_host DIR FLAGS...: the host half's driver in DIR/emulate_host_driver.
build_host() {
  local dir=$1; shift
  mkdir -p "$dir"
  local inc=$root/csrc cmds=()
  for t in float f16 bf16 int32_t; do
    for op in OpSum OpMax OpMin; do
      cmds+=("$dir/ai_${t}_${op}.o|$inc/cuda/allreduce_inst.cu|-x c++ -DNVRAR_INST_T=$t -DNVRAR_INST_OP=$op")
    done
  done
  for t in float f16 bf16; do cmds+=("$dir/fi_$t.o|$inc/cuda/fused_inst.cu|-x c++ -DNVRAR_INST_T=$t"); done
  cmds+=("$dir/runtime.o|$inc/cuda/runtime.cu|-x c++"
         "$dir/allreduce.o|$inc/cuda/allreduce.cu|-x c++" "$dir/fused.o|$inc/cuda/fused.cu|-x c++"
         "$dir/emu.o|$inc/emu/emu.cpp|" "$dir/host_emu.o|$inc/emu/host_emu.cpp|"
         "$dir/host_driver.o|$inc/emu/host_driver.cpp|")
  printf '%s\n' "${cmds[@]}" | NVRAR_EMU_FLAGS="$* -DNVRAR_EMU_HOST -I$inc/emu/host" NVRAR_EMU_INC="$inc" xargs -P "$jobs" -I{} bash -c '
    IFS="|" read -r out src defs <<<"$1"
    # shellcheck disable=SC2086
    compile "$out" "$src" "$NVRAR_EMU_INC" $NVRAR_EMU_FLAGS $defs' _ {} ||
    return 1
  "$cxx" -pthread "$@" "$dir"/*.o -o "$dir/emulate_host_driver"
}

if [ "$mutations" = 1 ]; then
  # Each mutant: NAME|FILE|PYTHON-REPLACEMENTS|SANITIZER|CASES. The replacement must apply (else
  # the mutation is reported as not applied: the source moved and this list must follow).
  mut_root="$build/mutants"
  rm -rf "$mut_root"; mkdir -p "$mut_root"
  total=0 caught=0
  run_mutant() {
    # NAME FILE SANITIZER OLD NEW [OLD NEW]... -- DRIVER-ARGS...
    local name=$1 file=$2 san=$3; shift 3
    local pairs=()
    while [ "$1" != "--" ]; do pairs+=("$1"); shift; done
    shift
    local src="$mut_root/$name/csrc" dir="$mut_root/$name/$san"
    rm -rf "$src"; mkdir -p "$src"; cp -rp "$root/csrc/." "$src/"
    if ! python3 - "$src/$file" "${pairs[@]}" <<'PY'
import sys
path, rest = sys.argv[1], [a.encode().decode("unicode_escape") for a in sys.argv[2:]]
text = open(path).read()
for old, new in zip(rest[0::2], rest[1::2]):
    if old not in text:
        sys.exit(1)
    text = text.replace(old, new)
open(path, "w").write(text)
PY
    then
      echo "mutation $name: NOT APPLIED (a pattern is not in $file any more: update scripts/emulate.sh)"; return 1
    fi
    local flags=("${plain_flags[@]}"); [ "$san" = tsan ] && flags=("${tsan_flags[@]}")
    # The objects that do not include the device code are shared between mutants; the driver
    # includes cuda/params.h and cuda/launch_params.h (the host side of a launch), so a mutant of
    # those builds its own driver.o and shares nothing it built.
    local shared=(emu driver)
    case "$file" in cuda/params.h|cuda/launch_params.h) shared=(emu) ;; esac
    mkdir -p "$dir"
    for o in "${shared[@]}"; do
      [ -f "$mut_root/common-$san/$o.o" ] && cp -p "$mut_root/common-$san/$o.o" "$dir/$o.o"
    done
    if ! NVRAR_EMU_KEEP="${shared[*]/%/.o}" build_driver "$dir" "$src" 1 "${flags[@]}" >"$dir/build.log" 2>&1; then
      echo "mutation $name: BUILD FAILED (see $dir/build.log)"; return 1
    fi
    mkdir -p "$mut_root/common-$san"
    for o in "${shared[@]}"; do cp -p "$dir/$o.o" "$mut_root/common-$san/"; done
    local log="$dir/run.log"
    set +e
    # Under ThreadSanitizer the first report ends the run (GCC 12's runtime can deadlock when
    # reports and thread exits meet; a mutant needs one report only).
    TSAN_OPTIONS="halt_on_error=1 report_signal_unsafe=0 history_size=4" "$dir/emulate_driver" --seed "$seed" "$@" >"$log" 2>&1
    local rc=$?
    set -e
    local first; first=$(grep -m1 '^FAIL' "$log" || true)
    if [ $rc -ne 0 ] && [ -n "$first" ]; then
      echo "mutation $name: caught ($san): ${first:0:300}"; return 0
    fi
    local race; race=$(grep -m1 -A2 'WARNING: ThreadSanitizer' "$log" | tr -s ' \n' ' ' || true)
    if [ $rc -ne 0 ] && [ -n "$race" ]; then
      echo "mutation $name: caught ($san): ${race:0:300}"; return 0
    fi
    echo "mutation $name: NOT CAUGHT ($san, exit $rc; $(tail -1 "$log"))"; return 1
  }
  m() { total=$((total + 1)); if run_mutant "$@"; then caught=$((caught + 1)); fi; }
  # (the mutants are built with float32 kernels only: every case named below is a float32 case)
  m wait-acquire-relaxed cuda/device.cuh tsan \
    'if (ok) v = ld_acquire_sys(c);' 'if (ok) v = ld_relaxed_sys(c);' \
    -- --only "allreduce 2x2 float32 sum two-shot n=1000" --only "allreduce 2x2 float32 max two-shot n=1007 ll"
  m signal-lanes-no-release cuda/device.cuh tsan \
    'desc.shape);\n      st_release_sys(c, word);' 'desc.shape);\n      st_relaxed_sys(c, word);' \
    -- --only "allreduce 2x2 float32 sum two-shot n=1000" --only "allreduce 2x2 float32 max two-shot n=1007 ll"
  m ll-unpack-no-zeroing cuda/device.cuh plain \
    'st_quad(p, zero, m);  // NOTE [LL zones]' '(void)zero;' \
    'st_quad(stream + q * kLLQuad, zero, kLLQuad);' '(void)stream;' \
    -- --only "allreduce 2x1 float32 sum two-shot n=900 ll" --repeat 3
  m epoch-off-by-one cuda/allreduce_kernel.cuh plain \
    'kp.state->epoch = e0 + nchunks;' 'kp.state->epoch = e0 + nchunks - 1;' \
    -- --only "allreduce 2x2 float32" --only "allreduce 2x1 float32"
  m abort-word-no-origin cuda/device.cuh plain \
    '<< 32) | static_cast<uint32_t>(origin);' '<< 32);' \
    -- --only "remote abort" --repeat 2
  m call-description-unchecked cuda/device.cuh plain \
    'return desc_equal(theirs, desc);\n  }\n\n  // What a call mismatch records' 'return true || desc_equal(theirs, desc);\n  }\n\n  // What a call mismatch records' \
    -- --only "1x2 collision" --only "2x2 collision"
  m put-trailer-unchecked cuda/device.cuh plain \
    'if (ok && (inter ? in_wire() && !trailer_matches(cell, v, peer) : !desc_matches(cell))) {' 'if (ok && (inter ? false : !desc_matches(cell))) {' \
    -- --only "collision 100000 vs 131409 put-signal"
  m put-trailer-not-sent cuda/device.cuh plain \
    'const size_t wire = static_cast<size_t>(reinterpret_cast<char*>(t + kTrailerWords) - src);' 'const size_t wire = bytes;' \
    -- --only "allreduce 2x1 float32" --only "allreduce 3x1 float32"
  m ll-desc-unchecked cuda/device.cuh plain \
    'return desc_equal(theirs, desc);\n  }\n\n  // The description' 'return true || desc_equal(theirs, desc);\n  }\n\n  // The description' \
    -- --only "collision 100000 vs 131409 ll"
  m channel-sends-early cuda/device.cuh plain \
    'const bool last = prev == static_cast<unsigned>(ch_end - ch_first) - 1;' 'const bool last = prev == 0;' \
    -- --only "allreduce 3x1 float32 max one-shot n=2500" --only "allreduce 2x2 float32 sum two-shot n=5000" --repeat 2
  m channel-count-unfenced cuda/device.cuh tsan \
    '      __threadfence();  // releases my part' '      // (mutant: no fence) releases my part' \
    -- --only "allreduce 3x1 float32 max one-shot n=2500" --only "allreduce 2x2 float32 sum two-shot n=5000"
  # The channel's wire cut at its first part: the later blocks' parts are neither sent nor checked
  # (NOTE [channels]: the wire ends with the last non-empty part).
  m channel-wire-cut-short cuda/allreduce_kernel.cuh plain \
    'while (tp.ch_wire_last > tp.ch_first && inter_msg(tp.ch_wire_last) == 0) --tp.ch_wire_last;' 'while (tp.ch_wire_last > tp.ch_first) --tp.ch_wire_last;' \
    -- --only "allreduce 3x2 float32" --only "allreduce 3x1 float32 max one-shot n=2500"
  # A launch that gathers slices into channels made an ordinary one (not cooperative): in block
  # waves a channel's blocks are not all resident and its message never leaves.
  m cooperative-launch-dropped cuda/params.h plain \
    'return clamp_channels(channels) < blocks; }' 'return false && clamp_channels(channels) < blocks; }' \
    -- --waves --only "allreduce 2x2 float32 sum two-shot n=5000" --case-timeout 10
  # The consistency point before a put-with-signal's trailer and data are read skipped: in
  # proxy-consistency mode they may not be visible yet.
  m consistency-point-skipped cuda/device.cuh plain \
    'nvshmem_uint64_wait_until(c, NVSHMEM_CMP_GE, target);' '(void)target;' \
    -- --consistency --only "allreduce 2x1 float32" --only "allreduce 3x1 float32"
  # fail() waits for its remote aborts' delivery (a fence, IBGDA's quiet): with a stalled proxy
  # it never returns (no deadline inside NVSHMEM).
  m fail-waits-for-delivery cuda/device.cuh plain \
    'word, NVSHMEM_SIGNAL_SET, r);\n    }' 'word, NVSHMEM_SIGNAL_SET, r);\n    }\n    nvshmem_fence();' \
    -- --only "stalled proxy" --case-timeout 8
  # The entry check dropped: a replay after a failure runs a round on slots of unknown state and
  # does not trap (NOTE [loud after failure]).
  m entry-check-dropped cuda/allreduce_kernel.cuh plain \
    '  if (tp.failed_before(e0)) {' '  (void)e0;\n  if (false) {' \
    -- --only "replay after failure 2x2"
  echo "mutations: $caught of $total caught"
  [ "$caught" = "$total" ]
  exit $?
fi

if [ "$host" = 1 ]; then
  args=(--seed "$seed" "${only[@]}")
  [ "$quick" = 1 ] && args+=(--quick)
  if [ "$coverage" = 1 ]; then
    dir="$build/host-coverage"
    rm -f "$dir"/*.gcda
    build_host "$dir" -O0 --coverage
    set +e
    "$dir/emulate_host_driver" "${args[@]}" >"$dir/run.log" 2>&1
    rc=$?
    set -e
    grep -E '^(FAIL|emulated host)' "$dir/run.log" || tail -5 "$dir/run.log"
    (cd "$dir" && for o in runtime.o allreduce.o fused.o ai_*.o fi_*.o; do gcov -t -p "$o.gcno" 2>/dev/null; done) |
      coverage_report "" cuda/runtime.cu cuda/allreduce.cu cuda/fused.cu cuda/allreduce_inst.cu cuda/fused_inst.cu
    exit $rc
  fi
  if [ "$tsan" = 1 ]; then
    dir="$build/host-tsan"
    build_host "$dir" "${tsan_flags[@]}"
    tsan_env
  else
    dir="$build/host-plain"
    build_host "$dir" "${plain_flags[@]}"
  fi
  exec "$dir/emulate_host_driver" "${args[@]}"
fi

if [ "$coverage" = 1 ]; then
  dir="$build/coverage"
  rm -f "$dir"/*.gcda
  build_driver "$dir" "$root/csrc" 0 -O0 --coverage
  args=(--seed "$seed" "${only[@]}")
  [ "$quick" = 1 ] && args+=(--quick)
  set +e
  "$dir/emulate_driver" "${args[@]}" | tail -1
  set -e
  (cd "$dir" && for o in k_*.o; do gcov -t -p "$o.gcno" 2>/dev/null; done) |
    coverage_report "the device code" cuda/device.cuh cuda/allreduce_kernel.cuh cuda/fused_kernel.cuh
  exit 0
fi

# nvrar.settings' GPU defaults as the driver takes them (--gpu-defaults K=V,...: GPU_LAUNCH, max_bytes,
# the LL threshold, the one-shot threshold for every NxG up to 16x16, GPU_LAUNCH["channels"] where set),
# read, never copied. settings.py needs the native module only for its algorithm codes: without a
# built one, it is loaded under a stand-in package.
gpu_defaults() {
  (cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'PY'
import importlib.util, sys, types
try:
    from nvrar import settings as st
except ImportError:
    pkg = types.ModuleType("nvrar"); pkg.__path__ = []
    c = types.ModuleType("nvrar._C"); c.ALGORITHM_CODES = {}
    pkg._C = c
    sys.modules.update({"nvrar": pkg, "nvrar._C": c})
    spec = importlib.util.spec_from_file_location("nvrar.settings", "nvrar/settings.py")
    st = importlib.util.module_from_spec(spec)
    sys.modules["nvrar.settings"] = st
    spec.loader.exec_module(st)
gpu = st.GPU_LAUNCH
kv = {"max_blocks": gpu["max_blocks"], "block_bytes": gpu["block_bytes"], "max_bytes": st.MAX_BYTES["cuda"],
      "ll_max_bytes": st.LL_MAX_BYTES["cuda"]}
for n in range(1, 17):
    for g in range(1, 17):
        kv[f"oneshot_max.{n}x{g}"] = st.Settings.oneshot_max(types.SimpleNamespace(oneshot_max_bytes=None, device="cuda"),
                                                             g, n)
if "channels" in gpu:
    kv["channels"] = gpu["channels"]
print(",".join(f"{k}={int(v)}" for k, v in kv.items()))
PY
  )
}

if [ ${#ledger[@]} -gt 0 ]; then
  [ "$tsan$mutations$coverage$quick" = 0000 ] && [ ${#only[@]} = 0 ] ||
    { echo "emulate.sh: --ledger takes --algorithm, --dtype, --threads, --channels, --ll-max-bytes and --seed only" >&2; exit 2; }
  defaults=$(gpu_defaults) || { echo "emulate.sh: cannot read nvrar.settings' GPU defaults" >&2; exit 3; }
  kernel=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
  # The device code's own version: the last commit that changed it (and -dirty if it has changes).
  dev_paths=(csrc/cuda csrc/protocol csrc/common)
  device_code=$(git -C "$root" log -1 --format=%h -- "${dev_paths[@]}" 2>/dev/null || echo unknown)
  [ -z "$(git -C "$root" status --porcelain -- "${dev_paths[@]}" 2>/dev/null)" ] || device_code="$device_code-dirty"
  dir="$build/plain"
  build_driver "$dir" "$root/csrc" 0 "${plain_flags[@]}" >&2
  has_threads=0
  for a in "${ledger_opts[@]}"; do [ "$a" = --threads ] && has_threads=1; done
  [ "$has_threads" = 1 ] || ledger_opts+=(--threads 32)
  exec "$dir/emulate_driver" --ledger "${ledger[@]}" --gpu-defaults "$defaults" --kernel "$kernel" --device-code "${device_code:-unknown}" --seed "$seed" "${ledger_opts[@]}"
fi

if [ "$tsan" = 1 ]; then
  dir="$build/tsan"
  build_driver "$dir" "$root/csrc" 0 "${tsan_flags[@]}"
  tsan_env
else
  dir="$build/plain"
  build_driver "$dir" "$root/csrc" 0 "${plain_flags[@]}"
fi
args=(--seed "$seed" "${only[@]}")
[ "$quick" = 1 ] && args+=(--quick)
[ "$waves" = 1 ] && args+=(--waves)
[ "$consistency" = 1 ] && args+=(--consistency)
# (the wire_budget cases, --only wire_budget, plan their calls with the GPU defaults)
defaults=$(gpu_defaults 2>/dev/null) && args+=(--gpu-defaults "$defaults")
exec "$dir/emulate_driver" "${args[@]}"
