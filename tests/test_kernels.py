"""The host reduction kernels (the shared slice functions of csrc/protocol/slice.h) against
independent references: numpy/torch conversions and IEEE arithmetic, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from nvrar import _C

torch = pytest.importorskip("torch")

F32, F16, BF16, I32 = (_C.DTYPE_CODES[n] for n in ("float32", "float16", "bfloat16", "int32"))
SUM, MAX, MIN, AVG = (_C.OP_CODES[n] for n in ("sum", "max", "min", "avg"))


def reduce(srcs, dtype_code, op, world=1):
    dst = np.empty_like(srcs[0])
    _C.reduce_into([dst.ctypes.data], [s.ctypes.data for s in srcs], srcs[0].size, dtype_code, op, world)
    return dst


def bits16(a):
    return a.view(np.uint16)


@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
@pytest.mark.parametrize("count", [1, 63, 64, 65, 1000, 4099])
def test_float32_sum_is_left_to_right(nsrc, count):
    rng = np.random.default_rng(count * 10 + nsrc)
    srcs = [(rng.standard_normal(count) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(nsrc)]
    want = srcs[0].copy()
    for s in srcs[1:]:
        want = (want + s).astype(np.float32)
    got = reduce(srcs, F32, SUM)
    assert got.tobytes() == want.tobytes()


def _fold_reference(srcs, dtype, op, world):
    """Left fold in fp32 (int32 wrapping), then the avg scale, then one rounding to the type."""
    if dtype == "int32":
        srcs = [s.numpy().astype(np.int64) for s in srcs]
        acc = srcs[0]
        for s in srcs[1:]:
            acc = {"sum": acc + s, "avg": acc + s, "max": np.maximum(acc, s), "min": np.minimum(acc, s)}[op]
            acc = ((acc + (1 << 31)) % (1 << 32)) - (1 << 31)
        if op == "avg":
            acc = np.trunc(acc / world)  # C integer division truncates toward zero
        return torch.from_numpy(acc.astype(np.int32))
    t = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    acc = srcs[0].float()
    for s in srcs[1:]:
        acc = {"sum": acc + s.float(), "avg": acc + s.float(), "max": torch.maximum(acc, s.float()),
               "min": torch.minimum(acc, s.float())}[op]
    if op == "avg":
        acc = acc * torch.tensor(np.float32(1.0) / np.float32(world))
    return acc.to(t)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32"])
@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_every_source_count_dtype_and_op_against_a_left_fold(dtype, op):
    """The host kernel has a path per source count (1-8, unrolled) and a generic one (more): each,
    with a tail, several destinations and a destination that is also a source, gives the left
    fold's bits (finite inputs; NaN handling has tests of its own)."""
    rng = np.random.default_rng(hash((dtype, op)) % (1 << 32))
    for nsrc in range(1, 11):
        for count in (5, 64, 64 * 3 + 17):
            if dtype == "int32":
                srcs = [torch.from_numpy(rng.integers(-(1 << 31), 1 << 31, count, dtype=np.int64).astype(np.int32))
                        for _ in range(nsrc)]
            else:
                t = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
                srcs = [torch.from_numpy((rng.standard_normal(count) * 10.0).astype(np.float32)).to(t)
                        for _ in range(nsrc)]
            want = _fold_reference(srcs, dtype, op, world=7)
            view = torch.int32 if dtype in ("float32", "int32") else torch.int16
            arrs = [s.view(view).numpy().copy() for s in srcs]
            outs = [np.empty_like(arrs[0]) for _ in range(2)]
            code = _C.DTYPE_CODES[dtype]
            # the last source doubles as the third destination (in-place, as a reduce-scatter's own shard)
            _C.reduce_into([o.ctypes.data for o in outs] + [arrs[-1].ctypes.data], [a.ctypes.data for a in arrs],
                           count, code, _C.OP_CODES[op], 7)
            w = want.view(view).numpy()
            for got in outs + [arrs[-1]]:
                assert np.array_equal(got, w), (dtype, op, nsrc, count)


def test_float16_rounding_matches_numpy_over_all_bit_patterns():
    """Every fp16 value plus a spread of others: fp32 sum then one correctly rounded conversion."""
    allv = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = allv[np.isfinite(allv)]
    rng = np.random.default_rng(0)
    for _ in range(3):
        a = finite.copy()
        b = rng.permutation(finite)
        with np.errstate(over="ignore"):  # sums beyond 65504 round to inf: part of the check
            want = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
        got = reduce([a, b], F16, SUM)
        assert np.array_equal(bits16(got), bits16(want)), np.flatnonzero(bits16(got) != bits16(want))[:10]


def test_float16_three_source_sums_and_avg_round_like_numpy():
    """Sums of three fp16 values (subnormal and overflowing results) and their avg over 2, 3 and 4
    ranks (ties, in the subnormal range too), rounded once, against numpy."""
    allv = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = allv[np.isfinite(allv)]
    rng = np.random.default_rng(7)
    a, b, c = finite.copy(), rng.permutation(finite), rng.permutation(finite) * np.float16(1 / 1024)
    f = [x.astype(np.float32) for x in (a, b, c)]
    with np.errstate(over="ignore"):
        want = ((f[0] + f[1]) + f[2]).astype(np.float16)
        # avg over 2 or 4 ranks halves or quarters exact sums: ties at every subnormal result
        want_avg = {w: (((f[0] + f[1]) + f[2]) * (np.float32(1.0) / np.float32(w))).astype(np.float16)
                    for w in (2, 3, 4)}
    assert np.array_equal(bits16(reduce([a, b, c], F16, SUM)), bits16(want))
    for w, wa in want_avg.items():
        assert np.array_equal(bits16(reduce([a, b, c], F16, AVG, world=w)), bits16(wa)), w


def test_float16_single_source_round_trip_is_exact():
    allv = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got = reduce([allv], F16, SUM)
    nan = np.isnan(allv)
    assert np.array_equal(bits16(got)[~nan], bits16(allv)[~nan])
    assert np.all(np.isnan(got[nan]))


def test_bfloat16_rounding_matches_torch():
    rng = np.random.default_rng(1)
    n = 200000
    a = torch.from_numpy((rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)).to(torch.bfloat16)
    b = torch.from_numpy((rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)).to(torch.bfloat16)
    c = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    want = ((a.float() + b.float()) + c.float()).to(torch.bfloat16)
    srcs = [t.view(torch.int16).numpy() for t in (a, b, c)]
    got = reduce(srcs, BF16, SUM)
    assert np.array_equal(got, want.view(torch.int16).numpy())


def test_bfloat16_avg_scales_once_in_fp32():
    W = 6
    xs = [torch.arange(-50, 50, dtype=torch.float32).to(torch.bfloat16) * (r + 1) for r in range(3)]
    acc = (xs[0].float() + xs[1].float()) + xs[2].float()
    want = (acc * (np.float32(1.0) / np.float32(W))).to(torch.bfloat16)
    got = reduce([x.view(torch.int16).numpy() for x in xs], BF16, AVG, world=W)
    assert np.array_equal(got, want.view(torch.int16).numpy())


@pytest.mark.parametrize("op,fn", [(MAX, np.maximum), (MIN, np.minimum)])
def test_float32_max_min_propagate_nan_as_the_canonical_quiet_nan(op, fn):
    rng = np.random.default_rng(2)
    a = rng.standard_normal(1000).astype(np.float32)
    b = rng.standard_normal(1000).astype(np.float32)
    a[::7] = np.nan
    b[::11] = np.uint32(0xffc12345).view(np.float32)  # a negative NaN with a payload
    got = reduce([a, b], F32, op)
    want = fn(a, b)  # numpy and torch propagate NaN
    assert np.array_equal(got, want, equal_nan=True)
    nan = np.isnan(want)
    assert np.all(got.view(np.uint32)[nan] == 0x7fc00000)  # whatever the payloads: same bits on every rank


@pytest.mark.parametrize("dtype,code,canon", [(np.float16, F16, 0x7e00), ("bfloat16", BF16, 0x7fc0)])
@pytest.mark.parametrize("op", [MAX, MIN])
def test_half_max_min_propagate_nan(dtype, code, canon, op):
    vals = np.array([np.nan, 1.0, np.nan, -np.inf, 2.0], np.float32)
    other = np.array([1.0, np.nan, np.nan, 5.0, -1.0], np.float32)
    if dtype == "bfloat16":
        a, b = (torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy() for v in (vals, other))
    else:
        a, b = vals.astype(dtype), other.astype(dtype)
    got = reduce([a, b], code, op).view(np.uint16)
    assert list(got[:3]) == [canon] * 3
    want = np.maximum(vals[3:], other[3:]) if op == MAX else np.minimum(vals[3:], other[3:])
    if dtype == "bfloat16":
        assert np.array_equal(got[3:], torch.from_numpy(want).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    else:
        assert np.array_equal(got[3:], want.astype(dtype).view(np.uint16))


@pytest.mark.parametrize("code", [F32, F16])
def test_signed_zeros_do_not_depend_on_operand_order(code):
    """max(-0, +0) = +0 and min(-0, +0) = -0 in either order (IEEE 754-2019 maximum/minimum;
    torch.maximum returns its first operand there)."""
    dt = np.float32 if code == F32 else np.float16
    a = np.array([-0.0, 0.0, -0.0, 0.0], dt)
    b = np.array([0.0, -0.0, -0.0, 0.0], dt)
    mx, mn = reduce([a, b], code, MAX), reduce([a, b], code, MIN)
    assert list(np.signbit(mx)) == [False, False, True, False]
    assert list(np.signbit(mn)) == [True, True, True, False]


def test_int32_sum_wraps_and_avg_truncates():
    a = np.array([2**31 - 1, -7, 7, -8, 5], dtype=np.int32)
    b = np.array([1, 0, 0, 0, 0], dtype=np.int32)
    assert reduce([a, b], I32, SUM)[0] == -(2**31)
    got = reduce([a[1:], b[1:]], I32, AVG, world=2)
    assert list(got) == [-3, 3, -4, 2]  # truncation toward zero, like C


def test_reduce_into_in_place_aliasing():
    """dst may be a source (the inter-node combine writes into its own landing zone)."""
    a = np.arange(1000, dtype=np.float32)
    b = np.ones(1000, dtype=np.float32)
    _C.reduce_into([b.ctypes.data], [a.ctypes.data, b.ctypes.data], 1000, F32, SUM, 1)
    assert np.array_equal(b, np.arange(1000, dtype=np.float32) + 1)


@pytest.mark.parametrize("count", [1, 64, 1000, 4099])
def test_reduce_into_several_destinations(count):
    """The push all-gather stores one reduced tile to several outputs; one may alias a source."""
    a = np.arange(count, dtype=np.float32)
    b = np.full(count, 0.5, dtype=np.float32)
    outs = [np.zeros(count, np.float32) for _ in range(3)]
    _C.reduce_into([o.ctypes.data for o in outs] + [b.ctypes.data], [a.ctypes.data, b.ctypes.data], count, F32, SUM, 1)
    want = np.arange(count, dtype=np.float32) + np.float32(0.5)
    for o in outs + [b]:
        assert o.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("nsrc", [2, 3, 5, 8, 9])
@pytest.mark.parametrize("count", [31, 32, 33, 100, 1027])
def test_sums_of_misaligned_memory_into_several_destinations(dtype, nsrc, count):
    """fp32 and int32 sums have a vector path of their own (csrc/cpu/reduce_kernels.cpp, sum_vec):
    memory at any 4-byte offset, tails of every length, several destinations, the first of them
    the second source (in place), against a left fold (fp32 rounding, int32 wrapping)."""
    rng = np.random.default_rng(count * 100 + nsrc)
    code = F32 if dtype == "float32" else I32

    def misaligned(a, shift):
        raw = np.zeros(a.size + 16, dtype=a.dtype)
        start = (-raw.ctypes.data % 64) // 4 + shift  # 64-byte aligned, then `shift` elements on
        view = raw[start:start + a.size]
        view[:] = a
        return view

    if dtype == "float32":
        vals = [(rng.standard_normal(count) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(nsrc)]
    else:
        vals = [rng.integers(-2**31, 2**31, count, dtype=np.int64).astype(np.int32) for _ in range(nsrc)]
    want = vals[0].astype(np.float32 if dtype == "float32" else np.int64)
    for v in vals[1:]:
        want = (want + v).astype(np.float32) if dtype == "float32" else (want + v)
    want = want.astype(np.float32) if dtype == "float32" else (((want + 2**31) % 2**32) - 2**31).astype(np.int32)
    srcs = [misaligned(v, (k + 1) % 4) for k, v in enumerate(vals)]
    outs = [misaligned(np.zeros(count, vals[0].dtype), shift) for shift in (3, 2)]
    _C.reduce_into([srcs[1].ctypes.data] + [o.ctypes.data for o in outs], [s.ctypes.data for s in srcs], count,
                   code, SUM, 1)
    for o in [srcs[1]] + outs:
        assert o.tobytes() == want.tobytes()


def _ll_reference(payload: bytes, flag: int) -> list:
    """The LL packets of protocol/ll.h by their definition: packet i carries payload bytes
    [4i, 4i + 4), zero-padded, little-endian, under the 32-bit flag; at least one packet."""
    n = max(1, (len(payload) + 3) // 4)
    padded = payload + bytes(4 * n - len(payload))
    return [(flag << 32) | int.from_bytes(padded[4 * i:4 * i + 4], "little") for i in range(n)]


@pytest.mark.parametrize("misalign", [0, 1, 4, 8, 12])
def test_ll_vector_packing_matches_packet_definition(misalign):
    """The quad (16-byte) packing and unpacking the GPU kernel uses give the packets and bytes of
    the packet-by-packet definition, for whole quads, partial quads, tails and unaligned buffers;
    unpacking writes no byte past the payload."""
    rng = np.random.default_rng(misalign)
    flag = 0x8001BEEF
    for nbytes in list(range(0, 70)) + [255, 256, 257, 4096, 4099]:
        raw = np.zeros(nbytes + 32 + 16, dtype=np.uint8)
        start = (-raw.ctypes.data) % 16 + misalign  # payload at a chosen distance from 16-byte alignment
        payload = raw[start:start + nbytes]
        payload[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        want = _ll_reference(payload.tobytes(), flag)
        packets = np.full(len(want) + 4, 0x5A5A5A5A5A5A5A5A, dtype=np.uint64)  # guard past the end
        n = _C.ll_pack_quads(payload.ctypes.data, nbytes, flag, packets.ctypes.data)
        assert n == len(want)
        assert [int(p) for p in packets[:n]] == want, nbytes
        assert all(int(p) == 0x5A5A5A5A5A5A5A5A for p in packets[n:]), f"{nbytes}: packed past the last packet"
        out_raw = np.full(nbytes + 32 + 16, 0xAB, dtype=np.uint8)
        o = (-out_raw.ctypes.data) % 16 + (misalign * 3) % 16
        _C.ll_unpack_quads(packets.ctypes.data, nbytes, out_raw[o:].ctypes.data)
        assert out_raw[o:o + nbytes].tobytes() == payload.tobytes(), nbytes
        assert (out_raw[:o] == 0xAB).all() and (out_raw[o + nbytes:] == 0xAB).all(), f"{nbytes}: wrote outside"
