"""Worker tasks of tests/test_fused.py (Communicator.all_reduce_add_rms_norm on real processes)."""

from __future__ import annotations

import hashlib
from typing import Any, Dict

import torch

import nvrar
from nvrar import _fused

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def ordered(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float tensor as integers in the order of the values (ulp distance = difference)."""
    if t.dtype == torch.float32:
        b = t.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(b < 0, -(b & 0x7FFFFFFF), b)
    b = t.contiguous().view(torch.int16).to(torch.int64)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def inputs(rank: int, rows: int, h: int, dtype: torch.dtype, case: int):
    g = torch.Generator().manual_seed(1000 * case + rank)
    x = (torch.randn(rows, h, generator=g) * 2).to(dtype)
    g0 = torch.Generator().manual_seed(77 + case)  # residual and weight: the same on every rank
    res = (torch.randn(rows, h, generator=g0) * 3).to(dtype)
    w = (torch.rand(h, generator=g0) + 0.5).to(dtype)
    return x, res, w


ALGORITHMS = ("one-shot", "two-shot", "auto")


def check_case(comm: Any, x0: Any, res0: Any, w: Any, eps: float, tag: str, to_host: Any = lambda t: t,
               sync: Any = lambda: None) -> tuple:
    """The fused call with every algorithm on copies of (x0, res0), against the unfused reference
    on the plain all-reduce's sum: residual bitwise, x within 1 ulp, one-shot equal to two-shot.
    Returns ({algorithm: (x, residual) on the host}, failures, worst ulp)."""
    s = comm.all_reduce(x0.clone())
    sync()
    ref_x, ref_r = _fused.reference(to_host(s), to_host(res0), to_host(w), eps)
    outs, failures, worst = {}, [], 0
    for algo in ALGORITHMS:
        x, r = x0.clone(), res0.clone()
        rx, rr = comm.all_reduce_add_rms_norm(x, r, w, eps, algorithm=algo)
        assert rx is x and rr is r
        sync()
        x, r = to_host(x), to_host(r)
        outs[algo] = (x, r)
        ulp = int((ordered(x) - ordered(ref_x)).abs().max())
        worst = max(worst, ulp)
        if not torch.equal(ordered(r), ordered(ref_r)):
            failures.append(f"{tag} {algo}: residual differs from residual + all_reduce(x)")
        if ulp > 1:
            failures.append(f"{tag} {algo}: x is {ulp} ulp from the reference")
    a, b = outs["one-shot"], outs["two-shot"]
    if not (torch.equal(ordered(a[0]), ordered(b[0])) and torch.equal(ordered(a[1]), ordered(b[1]))):
        failures.append(f"{tag}: one-shot and two-shot differ")
    return outs, failures, worst


def task_fused_check(args: Dict[str, Any]) -> dict:
    comm = nvrar.Communicator(ranks_per_node=args["G"], max_bytes=args.get("max_bytes", 4 << 20))
    failures, checked, worst = [], 0, 0
    digest = hashlib.sha256()
    case = 0
    for dname in args["dtypes"]:
        dtype = DTYPES[dname]
        for rows in args["rows"]:
            for h in args["hs"]:
                case += 1
                x0, res0, w = inputs(comm.rank, rows, h, dtype, case)
                eps = 1e-6 if case % 2 else 1e-5
                outs, bad, ulp = check_case(comm, x0, res0, w, eps, f"{dname} rows={rows} h={h}")
                failures += bad
                worst = max(worst, ulp)
                checked += len(ALGORITHMS)
                for t in outs["auto"]:
                    digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    comm.close()
    return {"failures": failures, "checked": checked, "worst_ulp": worst, "digest": digest.hexdigest()}


def task_fused_errors(args: Dict[str, Any]) -> dict:
    """Bad inputs raise before any communication (every rank runs them all, then one good call)."""
    comm = nvrar.Communicator(ranks_per_node=args["G"])
    x, r, w = inputs(comm.rank, 4, 8, torch.float32, 1)
    bad = {
        "shape": lambda: comm.all_reduce_add_rms_norm(x, r[:2].clone(), w),
        "weight": lambda: comm.all_reduce_add_rms_norm(x, r, w[:4].clone()),
        "dtype": lambda: comm.all_reduce_add_rms_norm(x, r.half(), w),
        "int": lambda: comm.all_reduce_add_rms_norm(x.int(), r.int(), w.int()),
        "kind": lambda: comm.all_reduce_add_rms_norm(x.numpy(), r, w),
        "eps": lambda: comm.all_reduce_add_rms_norm(x, r, w, eps=float("nan")),
        "overlap": lambda: comm.all_reduce_add_rms_norm(x, x, w),
        "noncontig": lambda: comm.all_reduce_add_rms_norm(x.t(), r.t(), w[:4].clone()),
        "scalar": lambda: comm.all_reduce_add_rms_norm(torch.tensor(1.0), torch.tensor(1.0), torch.ones(1)),
    }
    raised = {}
    for name, fn in bad.items():
        try:
            fn()
            raised[name] = None
        except (TypeError, ValueError) as exc:
            raised[name] = f"{type(exc).__name__}: {exc}"
    epoch = comm._ex.epoch
    xs, rs = x.clone(), r.clone()
    comm.all_reduce_add_rms_norm(xs, rs, w)
    s = comm.all_reduce(x.clone())
    ref_x, ref_r = _fused.reference(s, r, w, 1e-6)
    ok = bool(torch.equal(rs, ref_r)) and bool((ordered(xs) - ordered(ref_x)).abs().max() <= 1)
    comm.close()
    return {"raised": raised, "epoch_before_good_call": epoch, "good_ok": ok}


def task_fused_mismatch(args: Dict[str, Any]) -> dict:
    """Rank `victim` calls with another eps / h (same count) / the plain all_reduce."""
    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=args.get("timeout", 30))
    mode, victim = args["mode"], comm.rank == args["victim"]
    rows, h = (6, 4) if (victim and mode == "h") else (4, 6)
    x, r, w = inputs(comm.rank, rows, h, torch.float32, 1)
    try:
        if victim and mode == "plain":
            comm.all_reduce(x)
        else:
            comm.all_reduce_add_rms_norm(x, r, w, eps=1e-5 if (victim and mode == "eps") else 1e-6,
                                         algorithm=args.get("algo"))
        out = {"error": None}
    except nvrar.NvrarError as exc:
        out = {"error": str(exc), "type": type(exc).__name__}
    comm.close()
    return out


def task_fused_torch(args: Dict[str, Any]) -> dict:
    """nvrar.torch.all_reduce_add_rms_norm: eager (nvrar), under torch.compile(fullgraph=True),
    and the fallback (non-contiguous x: the group's all-reduce + torch math), on a gloo group."""
    import torch.distributed as dist

    import nvrar.torch as nt
    from _torch_tasks import finish, init

    init()
    rank = dist.get_rank()
    res: Dict[str, Any] = {}
    for dname in ("float32", "bfloat16"):
        dtype = DTYPES[dname]
        x0, r0, w = inputs(rank, 5, 300, dtype, 3)
        x, r = x0.clone(), r0.clone()
        out = nt.all_reduce_add_rms_norm(x, r, w, 1e-6)
        res[f"{dname}_returns_inputs"] = out[0] is x and out[1] is r
        s = x0.clone()
        dist.all_reduce(s)
        ref_x, ref_r = _fused.reference(s, r0, w, 1e-6)
        res[f"{dname}_eager_ok"] = bool(torch.equal(r, ref_r)) and int((ordered(x) - ordered(ref_x)).abs().max()) <= 1

        def layer(a, b, w=w):
            y = a * 1.0
            nt.all_reduce_add_rms_norm(y, b, w, 1e-6)
            return y + 0.0, b

        cx, cr = torch.compile(layer, fullgraph=True, backend=args["backend"])(x0.clone(), r0.clone())
        res[f"{dname}_compiled_equal"] = bool(torch.equal(cx, x)) and bool(torch.equal(cr, r))
        # Fallback: a non-contiguous x (a column slice) is not served by nvrar.
        big = torch.zeros(5, 600, dtype=dtype)
        big[:, :300] = x0
        fx, fr = big[:, :300], r0.clone()
        before = nt.stats()["native"]
        nt.all_reduce_add_rms_norm(fx, fr, w, 1e-6)
        res[f"{dname}_fallback_used"] = nt.stats()["native"] == before + 1
        res[f"{dname}_fallback_residual_ok"] = bool(torch.equal(fr, ref_r))
        res[f"{dname}_fallback_ulp"] = int((ordered(fx.contiguous()) - ordered(ref_x)).abs().max())
        res[f"{dname}_digest"] = hashlib.sha256(fx.contiguous().view(torch.uint8).numpy().tobytes()
                                                + x.view(torch.uint8).numpy().tobytes()).hexdigest()
    nt.reset()
    finish()
    return res


TASKS = {"fused_torch": task_fused_torch, "fused_check": task_fused_check, "fused_errors": task_fused_errors, "fused_mismatch": task_fused_mismatch}
