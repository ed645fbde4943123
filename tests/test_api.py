"""The Python API on a single rank: construction, properties, results, empty(), lifetime,
validation of bad input, environment variables."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import nvrar
from nvrar import env
from _matrix import bad_input_cases

torch = pytest.importorskip("torch")


@pytest.fixture
def comm():
    c = nvrar.Communicator(max_bytes=4096, heap_bytes=1 << 20)
    yield c
    c.close()


def test_single_rank_properties(comm):
    assert (comm.rank, comm.world_size, comm.ranks_per_node, comm.num_nodes) == (0, 1, 1, 1)
    assert comm.bootstrap == "single" and comm.backend == "cpu"
    assert comm.max_bytes == 4096
    assert "rank=0" in repr(comm)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_in_place_and_out_of_place_numpy(comm, dtype):
    x = np.arange(10000, dtype=np.int64).astype(dtype)
    ref = x.copy()
    assert comm.all_reduce(x) is x
    assert np.array_equal(x, ref)
    out = np.zeros_like(x)
    assert comm.all_reduce(x, "max", out=out) is out
    assert np.array_equal(out, ref)


def test_torch_tensor_and_reduceop(comm):
    import torch.distributed as dist

    x = torch.arange(100, dtype=torch.bfloat16)
    assert comm.all_reduce(x, dist.ReduceOp.SUM) is x
    assert comm.all_reduce(x, dist.ReduceOp.AVG) is x
    assert torch.equal(x, torch.arange(100, dtype=torch.bfloat16))


def test_zero_count_returns_at_once(comm):
    x = np.empty(0, np.float32)
    assert comm.all_reduce(x) is x
    assert comm._ex.epoch == 0


def test_empty_numpy_and_torch(comm):
    a = comm.empty((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.c_contiguous
    b = comm.empty(7, torch.bfloat16)
    assert b.shape == (7,) and b.dtype == torch.bfloat16
    c = comm.empty(4, "bfloat16")
    assert c.dtype == torch.bfloat16
    base = comm._ex.pool_address
    for arr in (a, b.view(torch.int16).numpy(), c.view(torch.int16).numpy()):
        ptr = arr.__array_interface__["data"][0]
        assert base <= ptr < base + comm._ex.pool_bytes
        assert (ptr - base) % 256 == 0
    a[...] = 2.0
    comm.all_reduce(a)
    assert np.all(a == 2.0)


def test_empty_pool_exhaustion_is_a_clear_error(comm):
    a = comm.empty(200_000, np.float32)  # 800 KB of the 1 MiB pool
    with pytest.raises(nvrar.NvrarError, match="no free block"):
        comm.empty(100_000, np.float32)
    view = a[10:]  # a view keeps the block alive
    del a
    gc.collect()
    with pytest.raises(nvrar.NvrarError, match="no free block"):
        comm.empty(100_000, np.float32)
    del view
    gc.collect()
    b = comm.empty(200_000, np.float32)  # the block came back
    assert b.size == 200_000


def test_empty_rejects_bad_arguments(comm):
    with pytest.raises(TypeError, match="float64"):
        comm.empty(4, np.float64)
    with pytest.raises(ValueError, match="negative"):
        comm.empty((2, -1), np.float32)
    # 2^64 elements: an int64 product would wrap to 0 ("cannot reshape array of size 0").
    with pytest.raises(nvrar.NvrarError, match=r"shape \(4294967296, 4294967296\) of float32 needs 73786976294838206464"):
        comm.empty((1 << 32, 1 << 32), np.float32)


@pytest.mark.parametrize("name", sorted(bad_input_cases(torch)))
def test_bad_input(comm, name):
    call, exc_type, needle = bad_input_cases(torch)[name]
    with pytest.raises({"ValueError": ValueError, "TypeError": TypeError}[exc_type], match=needle) as info:
        call(comm)
    print(f"{name}: {info.value}")


def test_close_is_idempotent_and_context_manager():
    with nvrar.Communicator() as c:
        c.all_reduce(np.ones(3, np.float32))
    assert c.closed
    c.close()
    with pytest.raises(nvrar.NvrarError, match="closed"):
        c.all_reduce(np.ones(3, np.float32))


def test_empty_outlives_close():
    c = nvrar.Communicator(heap_bytes=1 << 16)
    a = c.empty(1000, np.float32)
    c.close()
    a[...] = 3.0  # still mapped: close() defers the unmapping to the last block
    assert float(a.sum()) == 3000.0
    del a
    gc.collect()


def test_the_per_call_binding_checks_its_arguments_and_raises_nvrar_errors():
    """nvrar._C.cpu_all_reduce (Communicator.all_reduce's per-call path, bound without pybind11's
    dispatch): wrong arguments raise TypeError / OverflowError, never reach the executor, and the
    executor's errors arrive as nvrar.errors exceptions, as through CpuExecutor.all_reduce."""
    from nvrar import _C
    from nvrar.bootstrap import SingleBootstrap
    from nvrar.errors import NvrarError

    with nvrar.Communicator(group=SingleBootstrap()) as c:
        a = np.arange(8, dtype=np.float32)
        ptr = a.ctypes.data
        f32, add, auto = _C.DTYPE_CODES["float32"], _C.OP_CODES["sum"], _C.ALGORITHM_CODES["auto"]
        _C.cpu_all_reduce(c._ex, ptr, ptr, 8, f32, add, auto)
        assert a.tolist() == list(range(8))
        with pytest.raises(TypeError, match="CpuExecutor"):
            _C.cpu_all_reduce("not an executor", ptr, ptr, 8, f32, add, auto)
        with pytest.raises(TypeError, match="CpuExecutor"):
            _C.cpu_all_reduce(None, ptr, ptr, 8, f32, add, auto)
        with pytest.raises(TypeError, match="7 positional"):
            _C.cpu_all_reduce(c._ex, ptr, ptr)
        with pytest.raises((TypeError, OverflowError)):
            _C.cpu_all_reduce(c._ex, -1, ptr, 8, f32, add, auto)
        with pytest.raises(OverflowError):
            _C.cpu_all_reduce(c._ex, ptr, ptr, 8, 1 << 40, add, auto)
        for bad in ((99, add, auto), (f32, 99, auto), (f32, add, 99)):
            with pytest.raises(NvrarError, match="unknown"):
                _C.cpu_all_reduce(c._ex, ptr, ptr, 8, *bad)
        ex = c._ex
        c.close()
        with pytest.raises(NvrarError, match="closed"):
            _C.cpu_all_reduce(ex, ptr, ptr, 8, f32, add, auto)


def test_algorithm_for_and_bad_options():
    with nvrar.Communicator(algorithm="two-shot") as c:
        assert c.algorithm_for(8) == "two-shot"
        assert c.algorithm_for(8, "one-shot") == "one-shot"
    with pytest.raises(ValueError, match="algorithm"):
        nvrar.Communicator(algorithm="bogus")
    with pytest.raises(ValueError, match="timeout"):
        nvrar.Communicator(timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        nvrar.Communicator(timeout=1e10)
    with pytest.raises(ValueError, match="max_bytes"):
        nvrar.Communicator(max_bytes=10)
    with pytest.raises(ValueError, match="ranks_per_node"):
        nvrar.Communicator(ranks_per_node=0)
    with pytest.raises(ValueError, match="divide"):
        nvrar.Communicator(ranks_per_node=2)


def test_parse_bytes():
    assert env.parse_bytes("4096") == 4096
    assert env.parse_bytes("64K") == 65536
    assert env.parse_bytes("2M") == 2 << 20
    assert env.parse_bytes("1.5KiB") == 1536
    for bad in ("", "abc", "1Q", "-4K", "0.3"):
        with pytest.raises(ValueError):
            env.parse_bytes(bad)


def test_env_defaults_and_validation(monkeypatch):
    monkeypatch.setenv("NVRAR_TIMEOUT_S", "7.5")
    monkeypatch.setenv("NVRAR_MAX_BYTES", "64K")
    with nvrar.Communicator() as c:
        assert c.timeout == 7.5 and c.max_bytes == 65536
    monkeypatch.setenv("NVRAR_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="NVRAR_MAX_BYTES"):
        nvrar.Communicator()
    with pytest.raises(KeyError):
        env.get_int("NVRAR_NOT_DOCUMENTED")


def test_no_segment_left_in_dev_shm():
    before = set(os.listdir("/dev/shm"))
    c = nvrar.Communicator()
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("nvrar-")]
    c.close()


def test_interpreter_exit_with_live_communicator_is_clean():
    code = ("import nvrar, numpy as np\n"
            "c = nvrar.Communicator()\n"
            "a = c.empty(10, np.float32)\n"
            "a[:] = 1\nc.all_reduce(a)\nprint('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_build_info_reports_cpu_executor():
    info = nvrar.build_info()
    assert {"cuda", "nvshmem_version", "cuda_archs"} <= set(info)
    assert info["cpu_executor"] is True


def test_orphaned_segment_of_a_dead_process_is_swept(tmp_path):
    """A segment left by a process that died during setup (its pid gone, older than any setup)
    is unlinked by the next Communicator of the same user."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    name = f"/dev/shm/nvrar-{pid}-{'0' * 32}"
    with open(name, "wb") as f:
        f.write(b"x")
    old = os.stat(name).st_mtime - 7200
    os.utime(name, (old, old))
    fresh = f"/dev/shm/nvrar-{pid}-{'1' * 32}"
    with open(fresh, "wb") as f:
        f.write(b"x")
    try:
        nvrar.Communicator().close()
        assert not os.path.exists(name), "orphan not swept"
        assert os.path.exists(fresh), "a recent segment must be left alone (its setup may be running)"
    finally:
        for n in (name, fresh):
            if os.path.exists(n):
                os.unlink(n)


def test_block_returned_while_the_pool_lock_is_held_does_not_deadlock():
    """A garbage collection can finalize an empty() block inside alloc(), with the pool lock held."""
    code = ("import gc, numpy as np, nvrar\n"
            "c = nvrar.Communicator(heap_bytes=1 << 20)\n"
            "a = c.empty(1000, np.float32)\n"
            "with c._pool._lock:\n"
            "    del a\n"
            "    gc.collect()\n"
            "b = c.empty(200000, np.float32)\n"
            "print('ok', c._pool.live())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.split() == ["ok", "1"], res.stdout + res.stderr
