#!/usr/bin/env bash
# The CPU sweep behind the README's results: 2 ranks (launched through mpirun when available),
# 8 KB - 16 MB, nvrar (ordinary and symmetric buffers, every variant) against MPI_Allreduce and
# torch.distributed gloo in the same run, back-to-back calls (--timing warm: the table of
# docs/results.md). Writes docs/cpu-2ranks.{txt,json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
nvrar-bench --iters 200 --timing warm --json docs/cpu-2ranks.json --plot docs/cpu-2ranks.png "$@" | tee docs/cpu-2ranks.txt
python benchmarks/summarize.py docs/cpu-2ranks.json warm
