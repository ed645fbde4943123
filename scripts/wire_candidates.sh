#!/usr/bin/env bash
# The candidate plans that the wire model weighs against the defaults' choice (docs/gpu/wire-model.md,
# "How the defaults were chosen"): for each wire_budget cell (2x4, 2x8, 4x2 at 128 KB, 512 KB and 2 MB,
# bfloat16) the wire ledger of one call under every algorithm and inter-node protocol:
#   one-shot or two-shot  x  put-with-signal (--ll-max-bytes 0) or LL packets (--ll-max-bytes 16M)
# written to docs/gpu/ledgers/candidates/NxG-SIZE-ALGORITHM-PROTOCOL.json; the same for 2x4, 2x8,
# 4x2 and 4x4 at 16, 32 and 64 KB (where the one-shot and LL thresholds fall); and the channel
# counts 1, 2 and 4 of the defaults' plan at 2x8 512 KB (NxG-SIZE-channels-C.json).
#
#   scripts/wire_candidates.sh [--out DIR] [--only NxG-SIZE]
#
# tests/test_wire_budget.py prices these with the freshly measured ledger of the defaults' plan
# (nvrar model: h100-ndr-ibgda) and asserts that the defaults chose the fastest. Regenerate them when
# the device code changes what a step sends. Slow (one-shot with LL at 2 MB emulates 16,384 threads'
# packets): about 10 minutes on 2 cores. The last line is
#   wire candidates: N written, M failed
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/docs/gpu/ledgers/candidates" only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift ;;
    --only) only=${2:?--only needs NxG-SIZE}; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "wire_candidates.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
written=0 failed=0
run() {  # NAME ARGS...: one ledger into $out/NAME.json
  local name=$1; shift
  if timeout 600 "$root/scripts/emulate.sh" --ledger "$@" --seed 7 >"$out/$name.json.tmp" 2>"$out/$name.err"; then
    mv "$out/$name.json.tmp" "$out/$name.json"
    rm -f "$out/$name.err"
    written=$((written + 1))
    echo "wrote $name.json" >&2
  else
    rm -f "$out/$name.json.tmp"
    failed=$((failed + 1))
    echo "FAILED $name (see $out/$name.err)" >&2
  fi
}
plans() {  # "LAYOUTS" "SIZES": every algorithm x protocol of each cell
  local layout size alg
  for layout in $1; do
    for size in $2; do
      [ -z "$only" ] || [ "$only" = "$layout-$size" ] || continue
      for alg in one-shot two-shot; do
        run "$layout-$size-$alg-put_signal" "$layout" "$size" --algorithm "$alg" --ll-max-bytes 0
        run "$layout-$size-$alg-ll" "$layout" "$size" --algorithm "$alg" --ll-max-bytes 16M
      done
    done
  done
}
plans "2x4 2x8 4x2" "128K 512K 2M"
# The smaller messages that place the one-shot and LL thresholds (nvrar/settings.py cites them).
plans "2x4 2x8 4x2 4x4" "16K 32K 64K"
if [ -z "$only" ] || [ "$only" = 2x8-512K ]; then
  for c in 1 2 4; do run "2x8-512K-channels-$c" 2x8 512K --channels "$c"; done
fi
echo "wire candidates: $written written, $failed failed"
[ "$failed" = 0 ]
