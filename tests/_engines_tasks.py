"""Rank tasks of the engine tests (tests/test_engines_vllm.py, tests/test_engines_sglang.py): each
runs under .venv-engines/bin/python (scripts/engines_env.sh), imports the engine's own modules and
drives its own distributed layer, with nvrar's plugin loaded through the engine's own plugin
loader. Every result is compared with gloo's all-reduce over the same ranks, bit for bit (the data
are integers, exact in every dtype at these rank counts)."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

# The sizes (elements) and dtypes of vLLM v0.33.0's tests/distributed/test_custom_all_reduce.py:
# test_sizes there is `random.seed(42); [randint(1024, 2048 * 1024) for _ in range(8)]`, each
# rounded down to a multiple of 8 (tests/test_engines_vllm.py checks this list against that
# formula), each in float32, float16 and bfloat16 (graph_allreduce), with inputs
# torch.randint(1, 16, (sz,)); eager_allreduce adds 1024 float32 and 4096 bfloat16 elements.
VLLM_TEST_SIZES = [1341992, 234496, 53472, 1556168, 577800, 514592, 469128, 293656]
VLLM_TEST_DTYPES = ("float32", "float16", "bfloat16")
VLLM_EAGER_CASES = [(1024, "float32"), (4096, "bfloat16")]
# Odd sizes: not a multiple of the ranks, of a vector, nor of a cache line; one and two elements;
# int32, which vLLM's custom all-reduce refuses and nvrar serves.
ODD_CASES = [(1, "float32"), (2, "bfloat16"), (3, "float16"), (7, "float32"), (1023, "bfloat16"),
             (4097, "float16"), (65537, "float32"), (100003, "bfloat16"), (999, "int32")]
# Decode shapes (tokens, hidden): a row-parallel projection's output at batch 1, 8 and 32.
DECODE_SHAPES = [(1, 4096), (8, 4096), (32, 4096), (3, 5120)]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _data(shape: Any, dtype: str, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000003 * rank + salt)
    return torch.randint(1, 16, tuple(shape) if isinstance(shape, (list, tuple)) else (shape,),
                         generator=g).to(_dtype(dtype))


# --------------------------------------------------------------------------------------------- vLLM

_VLLM_CONFIG: Any = None

def _vllm_setup(args: dict) -> Any:
    """vLLM's own start-up of a worker's distributed state, as its workers do it: general plugins
    (nvrar's among them, through the vllm.general_plugins entry point), then
    init_distributed_environment and ensure_model_parallel_initialized."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.distributed import parallel_state as ps

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    # vLLM's default configuration as the current one, as its own tests' helper
    # (tests/utils.py: init_test_distributed_environment) sets it; left set for the whole task.
    # Its parallel sizes as a vLLM server would state them (vLLM's CPU platform, for one, sets
    # LOCAL_WORLD_SIZE to the TP size when it checks this configuration).
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    global _VLLM_CONFIG  # a reference: the context manager, collected, would unset the config
    parallel = ParallelConfig(tensor_parallel_size=args["tp"], pipeline_parallel_size=args.get("pp", 1))
    _VLLM_CONFIG = set_current_vllm_config(VllmConfig(parallel_config=parallel))
    _VLLM_CONFIG.__enter__()
    ps.init_distributed_environment(world_size=world, rank=rank, distributed_init_method="env://",
                                    local_rank=local, backend="gloo")
    ps.ensure_model_parallel_initialized(args["tp"], args.get("pp", 1))
    return ps


def _vllm_teardown(ps: Any) -> None:
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def task_engines_vllm_tp(args: dict) -> Dict[str, Any]:
    """tensor_model_parallel_all_reduce on vLLM's test sizes and dtypes, the eager cases, odd
    sizes and decode shapes; each result against gloo over the TP group, the input checked
    unchanged (nvrar's out-of-place contract), and vLLM's custom op torch.ops.vllm.all_reduce
    on a few of them (its contract: no mutation of the input)."""
    ps = _vllm_setup(args)
    from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
    from vllm.platforms import current_platform

    from nvrar.integrations import vllm as nv

    rank = dist.get_rank()
    tp = ps.get_tp_group()
    cases: List[Any] = []
    if args.get("vllm_sizes", True):
        cases += [(sz, dt) for sz in VLLM_TEST_SIZES for dt in VLLM_TEST_DTYPES] + VLLM_EAGER_CASES
    cases += ODD_CASES + [(list(s), "bfloat16") for s in DECODE_SHAPES]
    wrong: List[str] = []
    mutated: List[str] = []
    calls = 0
    for i, (shape, dt) in enumerate(cases):
        x = _data(shape, dt, rank, i)
        before = x.clone()
        ref = x.clone()
        dist.all_reduce(ref, group=tp.cpu_group)  # gloo
        out = tensor_model_parallel_all_reduce(x)
        calls += 1
        if not torch.equal(out, ref):
            wrong.append(f"{shape} {dt}")
        if not torch.equal(x, before):
            mutated.append(f"{shape} {dt}")
    custom_op_ok = True
    for i, (shape, dt) in enumerate(ODD_CASES[:4] + VLLM_EAGER_CASES):
        x = _data(shape, dt, rank, 500 + i)
        before = x.clone()
        ref = x.clone()
        dist.all_reduce(ref, group=tp.cpu_group)
        out = torch.ops.vllm.all_reduce(x, group_name=tp.unique_name)
        calls += 1
        custom_op_ok &= torch.equal(out, ref) and torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    # The pipeline-parallel group (when there is one) stays vLLM's: its all-reduce is still right.
    pp = ps.get_pp_group()
    pp_ok = None
    if pp.world_size > 1:
        x = _data(4096, "float32", rank, 999)
        ref = x.clone()
        dist.all_reduce(ref, group=pp.cpu_group)
        pp_ok = bool(torch.equal(pp.all_reduce(x.clone()), ref))
    report = {
        "platform": type(current_platform).__name__,
        "tp_name": tp.unique_name, "tp_ranks": tp.ranks, "pp_ranks": pp.ranks,
        "communicator": f"{type(tp.device_communicator).__module__}.{type(tp.device_communicator).__qualname__}",
        "pp_communicator": type(pp.device_communicator).__qualname__ if pp.device_communicator else None,
        "cases": len(cases), "calls": calls, "wrong": wrong, "mutated": mutated, "custom_op_ok": bool(custom_op_ok),
        "pp_ok": pp_ok, "stats": nv.stats(),
        "hostname": __import__("socket").gethostname(),
    }
    _vllm_teardown(ps)
    report["stats_after_destroy"] = nv.stats()
    return report


def task_engines_vllm_cuda_selection(args: dict) -> Dict[str, Any]:
    """NvrarCudaCommunicator imported, and chosen through both entry points for vLLM's CUDA
    platform. One process, no GPU: the general plugin is run by vLLM's own loader with vLLM's
    CudaPlatform set as the current platform (vllm.platforms' own setter); the platform plugin is
    called with vLLM's CUDA detection answering as on a GPU host (its NVML probe cannot run here),
    and vLLM's CUDA kernel extension replaced by an empty module (not built here). Nothing runs
    on a GPU: NvrarCudaCommunicator's all-reduce path is not run anywhere (docs/engines.md)."""
    os.environ["NVRAR_VLLM"] = "1"
    # vllm.platforms.cuda imports vLLM's CUDA kernels' extension (vllm._C_stable_libtorch) at
    # module level; this build (VLLM_TARGET_DEVICE=empty) has none, so an empty module stands in
    # for it. Nothing here calls a kernel.
    import sys
    import types

    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms as vp
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.platforms.cuda import CudaPlatform
    from vllm.plugins import load_general_plugins
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from nvrar.integrations import vllm as nv

    vp.current_platform = CudaPlatform()
    load_general_plugins()
    via_general = CudaPlatform.get_device_communicator_cls()
    general_cls = resolve_obj_by_qualname(via_general)
    os.environ["NVRAR_VLLM"] = "platform"
    real_detect = vp.cuda_platform_plugin
    vp.cuda_platform_plugin = lambda: "vllm.platforms.cuda.CudaPlatform"
    try:
        chosen = {ep.name: ep.load() for ep in __import__("importlib.metadata").metadata.entry_points(
            group="vllm.platform_plugins")}["nvrar"]()
    finally:
        vp.cuda_platform_plugin = real_detect
    platform_cls = resolve_obj_by_qualname(chosen)
    via_platform = platform_cls.get_device_communicator_cls()
    return {
        "via_general": via_general, "general_is_cuda_subclass": issubclass(general_cls, CudaCommunicator),
        "general_class": f"{general_cls.__module__}.{general_cls.__qualname__}",
        "platform": chosen, "platform_is_cuda_subclass": issubclass(platform_cls, CudaPlatform),
        "via_platform": via_platform, "expected": nv.COMMUNICATORS[
            "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"],
    }


def task_engines_vllm_bench(args: dict) -> Dict[str, Any]:
    """Times tensor_model_parallel_all_reduce on decode shapes (median of args["iters"] calls,
    after a warm-up), whichever communicator the environment made (nvrar's or vLLM's own)."""
    ps = _vllm_setup(args)
    from vllm.distributed.communication_op import tensor_model_parallel_all_reduce

    from nvrar.integrations import vllm as nv

    tp = ps.get_tp_group()
    rows = {}
    for tokens in args["tokens"]:
        x = _data([tokens, args["hidden"]], args.get("dtype", "bfloat16"), dist.get_rank(), tokens)
        for _ in range(args.get("warmup", 20)):
            tensor_model_parallel_all_reduce(x)
        times = []
        for _ in range(args["iters"]):
            dist.barrier(group=tp.cpu_group)
            t0 = time.perf_counter()
            tensor_model_parallel_all_reduce(x)
            times.append(time.perf_counter() - t0)
        rows[str(tokens)] = sorted(times)[len(times) // 2] * 1e6
    report = {"median_us": rows, "communicator": type(tp.device_communicator).__qualname__, "stats": nv.stats()}
    _vllm_teardown(ps)
    return report


# ------------------------------------------------------------------------------------------- SGLang

def task_engines_sglang_tp(args: dict) -> Dict[str, Any]:
    """SGLang's own GroupCoordinator, built by its own init_distributed_environment and
    initialize_model_parallel, with nvrar's hooks applied by SGLang's own load_plugins()
    (HookRegistry): tensor_model_parallel_all_reduce on CPU tensors (SGLang reduces those in
    place) and the out-of-place chain (_all_reduce_out_place with "auto" and "nvrar"), each
    against gloo."""
    import _engines_sglang_env  # noqa: F401  (the stubs, before any SGLang import)

    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce
    from sglang.srt.plugins.hook_registry import HookRegistry

    from nvrar.integrations import sglang as ns

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    ps.init_distributed_environment(world_size=world, rank=rank, distributed_init_method="env://",
                                    local_rank=rank, backend="gloo")
    _sglang_model_parallel(ps, world)
    tp = ps.get_tp_group()
    wrong: List[str] = []
    not_in_place: List[str] = []
    cases = [(sz, dt) for sz in VLLM_TEST_SIZES[:3] for dt in VLLM_TEST_DTYPES] + ODD_CASES + \
        [(list(s), "bfloat16") for s in DECODE_SHAPES]
    for i, (shape, dt) in enumerate(cases):
        x = _data(shape, dt, rank, i)
        ref = x.clone()
        dist.all_reduce(ref, group=tp.cpu_group)
        out = tensor_model_parallel_all_reduce(x)
        if not torch.equal(out, ref):
            wrong.append(f"{shape} {dt}")
        if out.data_ptr() != x.data_ptr():
            not_in_place.append(f"{shape} {dt}")
    outplace_ok = True
    methods = []
    for i, (shape, dt) in enumerate(ODD_CASES[:5]):
        for method in ("auto", ns.METHOD):
            x = _data(shape, dt, rank, 300 + i)
            before = x.clone()
            ref = x.clone()
            dist.all_reduce(ref, group=tp.cpu_group)
            out = tp._all_reduce_out_place(x, method)
            outplace_ok &= torch.equal(out, ref) and torch.equal(x, before)
        methods.append(tp._resolve_outplace_all_reduce_method(x))
    hooked = sorted(t for t in HookRegistry._patched if t.startswith(ns.TARGET))
    report = {"tp_name": tp.unique_name, "tp_ranks": tp.ranks, "cases": len(cases), "wrong": wrong,
              "not_in_place": not_in_place, "outplace_ok": bool(outplace_ok), "resolved": methods,
              "hooked": hooked, "stats": ns.stats(), "stubbed": list(_engines_sglang_env.STUBBED)}
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    report["stats_after_destroy"] = ns.stats()
    return report


def _sglang_model_parallel(ps: Any, tp_size: int) -> None:
    """initialize_model_parallel reads its widths from SGLang's parallel context: they are stated
    there first (get_parallel().override_permanently), as SGLang's own tests do without a server."""
    from sglang.srt import runtime_context as rc

    widths = {"tp_size": tp_size, "pp_size": 1, "moe_ep_size": 1, "attn_dp_size": 1, "attn_cp_size": 1,
              "moe_dp_size": 1, "attn_dcp_size": 1, "shared_experts_tp_size": None}
    fields = rc._parallel_fields()
    rc.get_parallel().override_permanently(**{k: v for k, v in widths.items() if k in fields})
    ps.initialize_model_parallel(backend="gloo")


TASKS = {name[len("task_"):]: fn for name, fn in list(globals().items())
         if name.startswith("task_engines_") and callable(fn)}
