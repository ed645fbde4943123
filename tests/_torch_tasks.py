"""Rank-side tasks of tests/test_torch.py (run by _worker.py in real gloo process groups)."""

from __future__ import annotations

import datetime
import importlib.util
import os
import time
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

        def native_ar(t, largest=largest):
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
    k = torch.ones(4)
    res["inplace_op_returns_its_tensor"] = torch.ops.nvrar.all_reduce_(k, "sum", "") is k and bool(torch.all(k == world))
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


# -- the "nvrar" backend and patch() over DTensor / functional collectives ----------------------

def int_mlp(hidden: int, seed: int = 0) -> torch.nn.Module:
    """An MLP with small-integer weights: every product and sum is an exact float32 integer."""
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden, bias=False), torch.nn.ReLU(),
                            torch.nn.Linear(4 * hidden, hidden, bias=False))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())
    return m


def tp_mlp(mesh, hidden: int = 32) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(int_mlp(hidden), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def mlp_inputs(hidden: int = 32):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(-3, 4, (4, hidden), generator=g).float() for _ in range(3)]


def dtensor_cases(mesh, reference_mesh, compile_backend, nt, group) -> dict:
    """The TP MLP through parallelize_module on `mesh`, eager and (optionally) compiled, against
    the same module on `reference_mesh` (gloo) and unsharded; served counts on `group`."""
    res = {}
    model, ref = tp_mlp(mesh), tp_mlp(reference_mesh)
    full = int_mlp(32)
    xs = mlp_inputs()
    with torch.no_grad():
        want = [ref(x) for x in xs]  # first: a cache keyed by an equal mesh would hand its group on
        before = nt.stats(group)
        outs = [model(x) for x in xs]
        res["eager_delta"] = nt.stats(group)["nvrar"] - before["nvrar"]
        res["eager_equal_gloo"] = all(torch.equal(a, b) for a, b in zip(outs, want))
        res["eager_equal_unsharded"] = all(torch.equal(a, full(x)) for a, x in zip(outs, xs))
        res["nonzero"] = all(bool(o.abs().sum() > 0) for o in outs)
        if compile_backend:
            compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
            before = nt.stats(group)
            got = [compiled(x) for x in xs]
            res["compiled_delta"] = nt.stats(group)["nvrar"] - before["nvrar"]
            res["compiled_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
    return res


def functional_cases(nt, group) -> dict:
    import torch.distributed._functional_collectives as fc

    world = dist.get_world_size(group)
    name = group.group_name
    res = {}
    before = nt.stats(group)
    y = fc.all_reduce(torch.full((5,), 2.0), "sum", group)
    x = torch.full((6,), 3.0)
    ret = torch.ops._c10d_functional.all_reduce_(x, "sum", name)
    torch.ops._c10d_functional.wait_tensor(x)
    outs = []
    for tensors in ([torch.ones(4), torch.ones(2)], [torch.ones(3, dtype=torch.float64)] * 2):  # gloo: one dtype
        outs += torch.ops._c10d_functional.all_reduce_coalesced(tensors, "sum", name)
    outs = [torch.ops._c10d_functional.wait_tensor(o) for o in outs]
    after = nt.stats(group)
    res["values"] = bool(torch.equal(torch.as_tensor(y), torch.full((5,), 2.0 * world))
                         and torch.equal(x, torch.full((6,), 3.0 * world)) and ret is x
                         and all(bool(torch.all(o == world)) for o in outs))
    res["nvrar_delta"] = after["nvrar"] - before["nvrar"]     # all_reduce, all_reduce_, 2 coalesced float32
    res["native_delta"] = after["native"] - before["native"]  # 2 coalesced float64
    return res


def other_collectives(group, reference) -> dict:
    """Every other collective on `group` gives what it gives on the gloo group `reference`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    # Every tensor handed to a collective stays referenced here until the end: a temporary whose
    # last Python reference goes while gloo's worker thread still holds it is freed by that
    # thread, which then needs the GIL while it holds gloo's queue lock; the next collective of
    # the main thread waits for that lock (a torch deadlock, seen here with all_to_all_single's
    # input: ranks timed out in the following all_gather_object after 120 s). Tensors that torch
    # creates inside a collective (all_gather_object's) cannot be kept so, and the same timeout
    # came back once (a CI run of 2026-12-02, both backend tests, in all_gather_object): so after
    # every collective the main thread also lets go of the GIL for a moment (settle), in which
    # gloo's worker thread finishes releasing what it held before the next collective needs its
    # queue lock.
    keep: list = []

    def settle() -> None:
        time.sleep(0.005)

    for name, pg in (("mine", group), ("ref", reference)):
        r = {}
        t = torch.arange(4.0) + 10 * rank
        lst = [torch.empty(4) for _ in range(world)]
        dist.all_gather(lst, t, group=pg)
        settle()
        r["all_gather"] = torch.stack(lst)
        big = torch.empty(4 * world)
        dist.all_gather_into_tensor(big, t, group=pg)
        settle()
        r["all_gather_into_tensor"] = big
        rs = torch.empty(2)
        rs_in = torch.arange(2.0 * world) * (rank + 1)
        keep.append(rs_in)
        dist.reduce_scatter_tensor(rs, rs_in, group=pg)
        settle()
        r["reduce_scatter_tensor"] = rs
        b = torch.full((3,), float(rank))
        dist.broadcast(b, src=dist.get_global_rank(pg, world - 1), group=pg)
        settle()
        r["broadcast"] = b
        dist.barrier(group=pg)
        settle()
        a2a = torch.empty(world)
        a2a_in = torch.arange(float(world)) + 100 * rank
        keep.append(a2a_in)
        dist.all_to_all_single(a2a, a2a_in, group=pg)
        settle()
        r["all_to_all_single"] = a2a
        red = torch.full((2,), float(rank + 1))
        dist.reduce(red, dst=dist.get_global_rank(pg, 0), group=pg)
        settle()
        r["reduce_dst"] = red if rank == 0 else torch.zeros(0)
        # (No all_gather_object: it is two all_gathers of tensors torch makes and drops inside it,
        # between which no settle() fits, and the deadlock above came back there a third time in
        # a CI run of 2026-12-03, rank 0 blocked on gloo's queue lock in its second all_gather.
        # It adds nothing on the backend: all_gather itself is compared above.)
        # send/recv in a ring
        nxt, prv = dist.get_global_rank(pg, (rank + 1) % world), dist.get_global_rank(pg, (rank - 1) % world)
        got = torch.empty(2)
        mine = torch.full((2,), float(rank))
        keep.append(mine)
        if rank % 2 == 0:
            dist.send(mine, nxt, group=pg)
            settle()
            dist.recv(got, prv, group=pg)
            settle()
        else:
            dist.recv(got, prv, group=pg)
            settle()
            dist.send(mine, nxt, group=pg)
            settle()
        r["send_recv"] = got
        out[name] = r
    dist.barrier(group=reference)  # (every collective above has completed on every rank)
    del keep
    return {k: bool(torch.equal(out["mine"][k], out["ref"][k])) for k in out["ref"]}


def work_cases(nt, group) -> dict:
    """The Work handles tell the truth, also about a failure (a closed communicator: every rank
    alike), and nt.reset() brings the group back."""
    from nvrar.errors import NvrarError

    world = dist.get_world_size(group)
    res = {}
    t = torch.ones(64)
    w = dist.all_reduce(t, async_op=True, group=group)
    res["ok_type"] = type(w).__name__
    res["ok"] = [w.is_completed(), w.is_success(), w.exception() is None, bool(w.wait()), bool(torch.all(t == world))]
    fut = dist.all_reduce(torch.ones(3), async_op=True, group=group).get_future()
    res["future"] = bool(torch.all(fut.wait()[0] == world))
    nt.communicator(group).close()
    w = dist.all_reduce(torch.ones(64), async_op=True, group=group)
    res["failed"] = [w.is_completed(), w.is_success(), type(w.exception()).__name__]
    try:
        w.wait()
        res["failed_wait"] = None
    except NvrarError as exc:
        res["failed_wait"] = str(exc)
    try:
        dist.all_reduce(torch.ones(64), group=group)
        res["failed_sync"] = None
    except NvrarError as exc:
        res["failed_sync"] = str(exc)
    nt.reset()
    t = torch.ones(64)
    dist.all_reduce(t, group=group)
    res["after_reset"] = bool(torch.all(t == world)) and nt.stats(group)["nvrar"] == 1
    return res


def task_backend(args: dict) -> dict:
    """init_process_group("nvrar"): DTensor TP (eager, compiled), functional collectives, every
    other collective against gloo, sub-groups, rank-consistent fallback, Work."""
    import nvrar.torch as nt
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(args.get("backend_string", "nvrar"), timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    world_pg = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    res = {"type": type(world_pg).__name__, "backend": dist.get_backend()}
    # distinct dim names: DTensor takes meshes over the same ranks for equal (and caches by them)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref_mesh = DeviceMesh.from_group(gloo, "cpu", mesh_dim_names=("ref",))
    res["mesh_group_is_world"] = mesh.get_group() is world_pg
    res["dtensor"] = dtensor_cases(mesh, ref_mesh, args.get("compile"), nt, world_pg)
    res["functional"] = functional_cases(nt, world_pg)
    before = nt.stats()
    f64 = torch.ones(5, dtype=torch.float64)
    dist.all_reduce(f64)                                  # dtype nvrar does not reduce: native
    prod = torch.full((3,), 2.0)
    dist.all_reduce(prod, op=dist.ReduceOp.PRODUCT)       # op nvrar does not do: native
    res["native_values"] = bool(torch.all(f64 == world) and torch.all(prod == 2.0 ** world))
    res["native_delta"] = nt.stats()["native"] - before["native"]
    res["others"] = other_collectives(world_pg, gloo)
    if world >= 4:  # a sub-group of the nvrar backend, and a 2-D mesh
        sub = dist.new_group([0, 1])
        if rank in (0, 1):
            t = torch.ones(10)
            dist.all_reduce(t, group=sub)
            res["sub"] = [type(sub).__name__, bool(torch.all(t == 2)), nt.stats(sub)]
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        tp = mesh2["tp"]
        res["mesh2_type"] = type(tp.get_group()).__name__
        half = world // 2
        gloo_rows = [dist.new_group(list(range(i * half, (i + 1) * half)), backend="gloo") for i in range(2)]
        gloo_tp = gloo_rows[rank // half]
        res["mesh2_dtensor"] = dtensor_cases(tp, DeviceMesh.from_group(gloo_tp, "cpu", mesh_dim_names=("ref",)), None, nt, tp.get_group())
    res["work"] = work_cases(nt, world_pg)
    before = nt.stats()
    nt.all_reduce(torch.ones(8))
    res["nt_all_reduce_counted_once"] = nt.stats()["nvrar"] - before["nvrar"]
    nt.reset()
    finish()
    return res


def task_patch_dtensor(args: dict) -> dict:
    """Unchanged DTensor / functional code over gloo groups, under patch(): served by nvrar;
    outside patch(): not."""
    import nvrar.torch as nt
    from torch._C._distributed_c10d import _resolve_process_group
    from torch.distributed.device_mesh import init_device_mesh

    init()
    world_pg = dist.group.WORLD
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    res = {}
    res["outside"] = dtensor_cases(mesh, mesh, None, nt, world_pg)
    with nt.patch():
        res["registry_swapped"] = type(_resolve_process_group(world_pg.group_name)).__name__
        res["inside"] = dtensor_cases(mesh, mesh, args.get("compile"), nt, world_pg)
        res["functional"] = functional_cases(nt, world_pg)
    res["registry_restored"] = _resolve_process_group(world_pg.group_name) is world_pg
    before = nt.stats()
    functional_cases(nt, world_pg)
    res["after_exit_delta"] = nt.stats()["nvrar"] - before["nvrar"]
    nt.reset()
    finish()
    return res


def task_hosts(args: dict) -> dict:
    """Ranks on two hosts (the upper half in a UTS namespace of its own, with another hostname).
    Without UCX (hidden from the import) the CPU executor cannot serve the world group: every rank
    falls back to gloo with a warning naming nvrar[ucx]. With UCX a group over all ranks is served
    by nvrar, hierarchically (a node per host), and so is the sub-group of each host."""
    import ctypes
    import socket
    import sys

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank >= world // 2:
        if ctypes.CDLL(None, use_errno=True).unshare(0x04000000) != 0:  # CLONE_NEWUTS
            return {"skip": f"unshare(CLONE_NEWUTS): errno {ctypes.get_errno()}"}
        socket.sethostname("nvrar-test-second-host")
    import nvrar.torch as nt

    torch.set_num_threads(1)
    dist.init_process_group("nvrar", timeout=datetime.timedelta(seconds=120))
    res = {"host": socket.gethostname()}
    subs = [dist.new_group(list(range(world // 2))), dist.new_group(list(range(world // 2, world)))]
    mine = subs[rank // (world // 2)]
    sys.modules["libucx"] = None  # type: ignore[assignment]  # `import libucx` fails: UCX "not installed"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = torch.ones(100)
        dist.all_reduce(t)
    del sys.modules["libucx"]
    res["world_value"] = bool(torch.all(t == world))
    res["world_stats"] = nt.stats()
    res["warned"] = any("cannot serve" in str(w.message) and "nvrar[ucx]" in str(w.message) for w in caught)
    across = dist.new_group(list(range(world)))
    t = torch.arange(1000.0) + rank
    dist.all_reduce(t, group=across)
    res["across_value"] = bool(torch.equal(t, torch.arange(1000.0) * world + world * (world - 1) // 2))
    res["across_stats"] = nt.stats(across)
    t = torch.ones(100)
    dist.all_reduce(t, group=mine)
    res["sub_value"] = bool(torch.all(t == world // 2))
    res["sub_stats"] = nt.stats(mine)
    nt.reset()
    finish()
    return res


TASKS.update({"backend": task_backend, "patch_dtensor": task_patch_dtensor, "hosts": task_hosts})
