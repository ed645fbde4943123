"""Rank-side tasks of tests/test_torch.py (run by _worker.py in real gloo process groups)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def init() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))


def finish() -> None:
    """Leave together: no rank may exit (tearing down the gloo store that rank 0 hosts) while
    another still uses the group."""
    dist.barrier()
    dist.destroy_process_group()


def tp_module():
    spec = importlib.util.spec_from_file_location("tp_decode", os.path.join(HERE, "..", "benchmarks", "tp_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def task_tp(args: dict) -> dict:
    """The TP block gives bitwise-identical outputs with nvrar and with the native all-reduce."""
    import nvrar.torch as nt

    init()
    tp = tp_module()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"identical": [], "calls": None, "largest": {}}
    hidden = args.get("hidden", 256)
    # float32: integers below 2^24 are exact; bfloat16: below 2^8, so sparser weights and a smaller
    # modulus keep every product, partial sum and all-reduce result exact (checked: "largest").
    for dtype, density, modulus, high in ((torch.float32, 0.1, 251.0, 7), (torch.bfloat16, 0.01, 5.0, 3)):
        block = tp.TPBlock(hidden, 4 * hidden, args.get("layers", 2), world, rank, dtype=dtype, density=density,
                           modulus=modulus)
        largest = [0.0]

        def native_ar(t):
            dist.all_reduce(t)
            largest[0] = max(largest[0], float(t.abs().max()))

        for step in range(3):
            x = tp.decode_inputs(step, 4, hidden, dtype, "cpu", high=high)
            native = block(x, native_ar)
            mine = block(x, lambda t: nt.all_reduce(t))
            out["identical"].append(bool(torch.equal(native, mine)) and bool(native.abs().sum() > 0))
        out["largest"][str(dtype)] = largest[0]
    out["calls"] = nt.stats()
    nt.reset()
    finish()
    return out


def task_compile(args: dict) -> dict:
    """torch.compile(fullgraph=True) of a TP layer that calls nvrar, against eager."""
    import nvrar.torch as nt

    init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    w_col = torch.randint(-2, 3, (64, 128)).float()
    w_row = torch.randint(-2, 3, (128, 64)).float()
    shard = slice(rank * 128 // dist.get_world_size(), (rank + 1) * 128 // dist.get_world_size())

    def tp_layer(x):
        h = torch.relu(x @ w_col[:, shard])
        y = h @ w_row[shard]
        nt.all_reduce(y)                      # in place, torch.distributed signature
        return x + y

    def tp_layer_functional(x):
        h = torch.relu(x @ w_col[:, shard])
        return x + torch.ops.nvrar.all_reduce(h @ w_row[shard], "sum", "")

    def product_async(x):  # an op nvrar does not do (native at run time), and a work handle
        y = x * 1.0
        nt.all_reduce(y, dist.ReduceOp.PRODUCT)
        w = nt.all_reduce(x, async_op=True)
        w.wait()
        return x + y

    x = torch.randint(-3, 4, (8, 64)).float()
    want = tp_layer(x.clone())
    res = {"backend": args["backend"]}
    for name, fn in (("inplace", tp_layer), ("functional", tp_layer_functional)):
        compiled = torch.compile(fn, fullgraph=True, backend=args["backend"])
        got = compiled(x.clone())
        res[name] = bool(torch.equal(got, want))
    world = dist.get_world_size()
    p = torch.full((4,), 2.0)
    got = torch.compile(product_async, fullgraph=True, backend=args["backend"])(p.clone())
    res["product_async"] = bool(torch.equal(got, torch.full((4,), 2.0 * world + 2.0 ** world)))
    res["calls"] = nt.stats()
    nt.reset()
    finish()
    return res


def task_patch(args: dict) -> dict:
    """Unchanged code calling dist.all_reduce runs on nvrar under patch(); the rest stays native."""
    import nvrar.torch as nt

    init()
    world = dist.get_world_size()

    def model_code(t):  # "unchanged" user code
        dist.all_reduce(t)
        return t

    res = {}
    before = nt.stats()
    with nt.patch():
        a = model_code(torch.ones(1000))
        res["inside_is_patched"] = dist.all_reduce is nt.all_reduce
        b = model_code(torch.ones(10, dtype=torch.float64))      # dtype nvrar does not reduce
        c = torch.ones(10)
        dist.all_reduce(c, op=dist.ReduceOp.PRODUCT)              # op nvrar does not do
        d = torch.full((5,), float(dist.get_rank()))
        dist.broadcast(d, src=0)                                  # other collectives untouched
        with nt.patch():                                          # nesting
            e = model_code(torch.ones(3))
        res["nested_still_patched"] = dist.all_reduce is nt.all_reduce
    after = nt.stats()
    res["restored"] = dist.all_reduce is nt._native_all_reduce

    @nt.patch()
    def decorated(t):
        dist.all_reduce(t)
        return t

    f = decorated(torch.ones(7))
    res["values_ok"] = bool(torch.all(a == world) and torch.all(b == world) and torch.all(c == 1)
                            and torch.all(d == 0) and torch.all(e == world) and torch.all(f == world))
    res["nvrar_delta"] = after["nvrar"] - before["nvrar"]
    res["native_delta"] = after["native"] - before["native"]
    res["after_decorator"] = nt.stats()["nvrar"] - after["nvrar"]
    res["restored_after_decorator"] = dist.all_reduce is nt._native_all_reduce
    w = nt.all_reduce(torch.ones(100), async_op=True)
    res["async_ok"] = bool(w.wait()) and bool(torch.all(w.result()[0] == world))
    # String ops reach the native backend too (custom ops always pass strings)
    g = torch.ops.nvrar.all_reduce(torch.ones(6, dtype=torch.float64), "sum", "")
    h = torch.ones(6, dtype=torch.float64)
    nt.all_reduce(h, "max")
    res["string_op_native_ok"] = bool(torch.all(g == world)) and bool(torch.all(h == 1))
    try:
        nt.all_reduce(torch.ones(2), "median")
        res["bad_op"] = None
    except ValueError as exc:
        res["bad_op"] = str(exc)
    nt.reset()
    finish()
    return res


def decisions(nt) -> list:
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int32):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, "max"):
            for n in (1, 1000, 4096, 65536, 1 << 20, 5 << 20):
                out.append(nt.decide(torch.empty(n, dtype=dtype), op))
    return out


def task_select(args: dict) -> dict:
    """Decisions over a grid of dtypes x ops x sizes, per rank (the test compares ranks), with the
    tuning table given by NVRAR_TUNING_FILE (which may differ per rank)."""
    import nvrar.torch as nt

    init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grid = decisions(nt)
    before = nt.stats()
    for n in args.get("calls", []):  # sizes to really reduce
        t = torch.ones(n // 4)
        nt.all_reduce(t)
        assert torch.all(t == dist.get_world_size())
    after = nt.stats()
    st = nt._groups[(dist.group.WORLD, "cpu")]
    res = {"grid": grid, "warnings": [str(w.message) for w in caught],
           "window": list(st.table.window()) if st.table else None,
           "nvrar_delta": after["nvrar"] - before["nvrar"], "native_delta": after["native"] - before["native"]}
    nt.reset()
    finish()
    return res


TASKS = {"tp": task_tp, "compile": task_compile, "patch": task_patch, "select": task_select}
