"""The correctness matrix that every multi-rank test runs (pytest-launched ranks and mpirun).

Exact data: rank r contributes small integers ((7 i + 3 r + salt) mod 11) - 5, so every sum, max,
min and avg is exact (or correctly rounded once) in every dtype, whatever the reduction order;
each rank checks its result against the value computed from all ranks' inputs, and hashes every
result so that the test can compare the hashes of all ranks: bitwise identity across ranks."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

OPS = ("sum", "max", "min", "avg")
DEVICE = "cpu"  # "cuda" for a GPU communicator: torch tensors on the current CUDA device
ALGORITHMS = ("one-shot", "two-shot")
MODES = ("inplace", "out", "zc_inplace", "zc_out")


def _torch():
    try:
        import torch

        return torch
    except ImportError:  # the matrix still covers numpy dtypes
        return None


def dtypes() -> List[Tuple[str, str, Any]]:
    """(kind, name, dtype) for every supported array kind and dtype."""
    out: List[Tuple[str, str, Any]] = [] if DEVICE == "cuda" else [
        ("numpy", "float32", np.float32),
        ("numpy", "float16", np.float16),
        ("numpy", "int32", np.int32),
    ]
    torch = _torch()
    if torch is not None:
        out += [
            ("torch", "float32", torch.float32),
            ("torch", "float16", torch.float16),
            ("torch", "bfloat16", torch.bfloat16),
            ("torch", "int32", torch.int32),
        ]
    return out


def contribution(rank: int, count: int, salt: int) -> np.ndarray:
    i = np.arange(count, dtype=np.int64)
    return (i * 7 + rank * 3 + salt) % 11 - 5


def expected(world: int, count: int, salt: int, op: str, name: str) -> np.ndarray:
    """The exact result as float64 (or int64) values, before the cast to the dtype."""
    xs = np.stack([contribution(r, count, salt) for r in range(world)]) if count else np.zeros((world, 0), np.int64)
    if op == "sum":
        return xs.sum(axis=0)
    if op == "max":
        return xs.max(axis=0)
    if op == "min":
        return xs.min(axis=0)
    s = xs.sum(axis=0)
    if name == "int32":
        return np.sign(s) * (np.abs(s) // world)  # C division: truncation toward zero
    # Floating avg: the fp32 sum scaled by the fp32 reciprocal of W, rounded once to the dtype.
    return s.astype(np.float32) * (np.float32(1.0) / np.float32(world))


def to_kind(values: np.ndarray, kind: str, dtype: Any) -> Any:
    if kind == "numpy":
        return values.astype(dtype)
    torch = _torch()
    t = torch.from_numpy(np.ascontiguousarray(values.astype(np.float32 if dtype != torch.int32 else np.int32))).to(dtype)
    return t.to(DEVICE) if DEVICE != "cpu" else t


def as_bytes(x: Any) -> bytes:
    if isinstance(x, np.ndarray):
        return x.tobytes()
    torch = _torch()
    return x.contiguous().cpu().view(torch.uint8).numpy().tobytes() if x.numel() else b""


def same(a: Any, b: Any) -> bool:
    return as_bytes(a) == as_bytes(b)


class Checker:
    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.failures: List[str] = []
        self.checked = 0
        self.hash = hashlib.sha256()

    def record(self, label: str, got: Any, want: Any, key: str = "") -> None:
        """Check got == want bitwise; hash `key` (default: the label) and the bits for the
        cross-rank comparison."""
        self.checked += 1
        data = as_bytes(got)
        self.hash.update((key or label).encode())
        self.hash.update(data)
        if data != as_bytes(want) and len(self.failures) < 20:
            self.failures.append(f"rank {self.comm.rank}: {label}: got {got.ravel()[:8]} want {want.ravel()[:8]}")

    def report(self) -> Dict[str, Any]:
        return {"checked": self.checked, "failures": self.failures, "digest": self.hash.hexdigest()}


def _buffer(comm: Any, kind: str, dtype: Any, values: Any, zero_copy: bool) -> Any:
    if not zero_copy:
        return values.copy() if kind == "numpy" else values.clone()
    buf = comm.empty(values.shape, dtype)
    buf[...] = values
    return buf


def run_case(comm: Any, chk: Checker, kind: str, name: str, dtype: Any, count: int, op: str, algorithm: str, mode: str,
             salt: int, want_cache: Dict[Tuple, Any]) -> None:
    key = (kind, name, count, op, salt)
    if key not in want_cache:
        want_cache[key] = to_kind(expected(comm.world_size, count, salt, op, name), kind, dtype)
    want = want_cache[key]
    mine = to_kind(contribution(comm.rank, count, salt), kind, dtype)
    x = _buffer(comm, kind, dtype, mine, mode.startswith("zc"))
    label = f"{kind}/{name}/n={count}/{op}/{algorithm}/{mode}"
    if mode.endswith("out"):
        out = np.empty_like(x) if kind == "numpy" else x.new_empty(x.shape)
        res = comm.all_reduce(x, op, out=out, algorithm=algorithm)
        assert res is out
        if not same(x, mine):
            chk.failures.append(f"rank {comm.rank}: {label}: out-of-place call modified its input")
    else:
        res = comm.all_reduce(x, op, algorithm=algorithm)
        assert res is x
    chk.record(label, res, want, key=f"{kind}/{name}/n={count}/{op}/{algorithm}")  # modes may differ by rank


def counts_for(comm: Any, quick: bool) -> List[int]:
    G = comm.ranks_per_node
    counts = [0, 1, 2, 7, 13, 127, 1021, 4099] if not quick else [0, 1, 13, 1021, 4099]
    if G > 1 and G - 1 not in counts:
        counts.append(G - 1)
    if not quick:
        counts.append(12289)  # several chunks at max_bytes = 8 KiB, for every dtype
    return counts


def run_matrix(comm: Any, quick: bool = False) -> Dict[str, Any]:
    chk = Checker(comm)
    cache: Dict[Tuple, Any] = {}
    for kind, name, dtype in dtypes():
        for count in counts_for(comm, quick):
            for op in OPS:
                for algorithm in ALGORITHMS:
                    for mode in MODES:
                        run_case(comm, chk, kind, name, dtype, count, op, algorithm, mode, salt=count % 5, want_cache=cache)
    rep = chk.report()
    rep["random"] = run_random(comm)
    return rep


def run_random(comm: Any) -> Dict[str, Any]:
    """Random float32 data: within the summation error bound of a float64 reference, and the same
    bits on every rank (the digest). Bound: |err_i| <= (W - 1) * u * sum_r |x_r[i]|, u = 2^-24, doubled
    for the final rounding to float32 (Higham, recursive summation, any order)."""
    chk = Checker(comm)
    worst = 0.0
    W = comm.world_size
    for count in (1, 1000, 5000):
        for algorithm in ALGORITHMS:
            xs = [np.random.default_rng(1000 * count + r).standard_normal(count).astype(np.float32) for r in range(W)]
            stack = np.stack(xs).astype(np.float64)
            ref = stack.sum(axis=0)
            scale = np.abs(stack).sum(axis=0)
            x = xs[comm.rank].copy()
            if DEVICE == "cuda":
                torch = _torch()
                t = torch.from_numpy(x).to(DEVICE)
                comm.all_reduce(t, "sum", algorithm=algorithm)
                x = t.cpu().numpy()
            else:
                comm.all_reduce(x, "sum", algorithm=algorithm)
            worst = max(worst, float(np.max(np.abs(x - ref) / scale)))
            chk.record(f"random/{count}/{algorithm}", x, x)
    rep = chk.report()
    rep["max_rel_err"] = worst
    rep["tolerance"] = 2.0 * max(1, W - 1) * 2.0 ** -24
    if worst > rep["tolerance"]:
        rep["failures"].append(f"rank {comm.rank}: random data error {worst:.3g} above the bound {rep['tolerance']:.3g}")
    return rep


def run_burst(comm: Any, calls: int, seed: int, max_count: int = 20000) -> Dict[str, Any]:
    """Back-to-back calls of varying size, op and variant, with no barrier in between."""
    rng = np.random.default_rng(seed)  # same seed on every rank: the same sequence of calls
    chk = Checker(comm)
    cache: Dict[Tuple, Any] = {}
    kinds = [d for d in dtypes() if d[1] in ("float32", "int32", "bfloat16")]
    for i in range(calls):
        kind, name, dtype = kinds[int(rng.integers(len(kinds)))]
        count = int(rng.integers(1, max_count))
        op = OPS[int(rng.integers(len(OPS)))]
        algorithm = ("auto", "one-shot", "two-shot")[int(rng.integers(3))]
        # Buffer modes differ between ranks within one call: peers that pull, take pushes into
        # their pool, or take cross-memory writes meet in the same all-gather.
        mode = MODES[(int(rng.integers(len(MODES))) + comm.rank) % len(MODES)]
        run_case(comm, chk, kind, name, dtype, count, op, algorithm, mode, salt=i % 11, want_cache=cache)
        if len(cache) > 64:
            cache.clear()
    return chk.report()


def bad_input_cases(torch: Any) -> Dict[str, Tuple[Callable[[Any], Any], str, str]]:
    """name -> (call, exception type name, substring of the message). Each must raise before
    any communication."""
    import torch.distributed as dist

    def readonly(c):
        a = np.zeros(4, np.float32)
        a.flags.writeable = False
        return c.all_reduce(a)

    def readonly_map(c, as_out):
        # A tensor over a read-only file mapping: a write there is SIGSEGV, not an exception.
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".bin") as f:
            f.write(b"\0" * 4096)
            f.flush()
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the array is not writable
                t = torch.from_numpy(np.memmap(f.name, dtype=np.float32, mode="r"))
            if as_out:
                return c.all_reduce(torch.zeros(1024), out=t)
            return c.all_reduce(t)

    def overlap(c):
        a = np.zeros(8, np.float32)
        return c.all_reduce(a[:4], out=a[2:6])

    return {
        "non_contiguous_numpy": (lambda c: c.all_reduce(np.zeros((4, 4), np.float32)[:, ::2]), "ValueError", "contiguous"),
        "non_contiguous_torch": (lambda c: c.all_reduce(torch.zeros(4, 3).t()), "ValueError", "contiguous"),
        "read_only": (readonly, "ValueError", "read-only"),
        "read_only_torch_memmap": (lambda c: readonly_map(c, False), "ValueError", "x lies in read-only memory"),
        "read_only_torch_memmap_out": (lambda c: readonly_map(c, True), "ValueError", "out lies in read-only memory"),
        "float64": (lambda c: c.all_reduce(np.zeros(4)), "TypeError", "float64"),
        "int64_torch": (lambda c: c.all_reduce(torch.zeros(4, dtype=torch.int64)), "TypeError", "int64"),
        "not_an_array": (lambda c: c.all_reduce([1.0, 2.0]), "TypeError", "list"),
        "out_shape": (lambda c: c.all_reduce(np.zeros(4, np.float32), out=np.zeros(5, np.float32)), "ValueError", "shape"),
        "out_dtype": (lambda c: c.all_reduce(np.zeros(4, np.float32), out=np.zeros(4, np.int32)), "TypeError", "dtype"),
        "out_kind": (lambda c: c.all_reduce(np.zeros(4, np.float32), out=torch.zeros(4)), "TypeError", "numpy"),
        "out_overlap": (overlap, "ValueError", "overlaps"),
        "unknown_op": (lambda c: c.all_reduce(np.zeros(4, np.float32), op="prod"), "ValueError", "prod"),
        "reduceop_product": (lambda c: c.all_reduce(np.zeros(4, np.float32), op=dist.ReduceOp.PRODUCT), "ValueError", "PRODUCT"),
        "wrong_device": (lambda c: c.all_reduce(torch.zeros(4, device="meta")), "ValueError", "meta"),
        "unknown_algorithm": (lambda c: c.all_reduce(np.zeros(4, np.float32), algorithm="three-shot"), "ValueError", "three-shot"),
        "negated_view": (lambda c: c.all_reduce(torch._neg_view(torch.ones(4))), "ValueError", "negated"),
    }
