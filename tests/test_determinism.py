"""Determinism as a contract (docs/api.md): a row's result is bitwise the same whatever batch it
travels in (1, 8 or 64 rows) and whichever algorithm serves it (one-shot, two-shot; across
nodes LL packets or put-with-signal, recursive doubling or halving-doubling, by the shard's
size), on every rank, for every layout."""

from __future__ import annotations

import pytest

from _launch import assert_all_ok, launch

pytest.importorskip("torch")

# (world, ranks per node): one node, several nodes with G = 2 and 4, and G = 1 (inter-node only).
LAYOUTS = [(4, 2), (6, 2), (3, 1), (8, 4), (2, 2), (4, 1), (5, 1)]


@pytest.mark.parametrize("world,G", LAYOUTS)
def test_a_row_is_bitwise_the_same_in_every_batch_and_algorithm(world, G):
    # LL packets for inter-node shards up to 16 KB: bf16 h=4096 rows in small batches go as LL,
    # larger batches as put-with-signal, so both transports serve the same rows.
    # Halving-doubling for inter-node shards from 64 KB (4 or more nodes: 4 x 1, 5 x 1 with a
    # folded node, 8 x 4 has 2 nodes and keeps recursive doubling): larger batches go by it, the
    # rows compared with them by recursive doubling.
    env = {"NVRAR_LL_MAX_BYTES": "16K", "NVRAR_HD_MIN_BYTES": "64K"}
    reports = assert_all_ok(launch(world, "det_rows", {"G": G, "hs": [4096, 8192]}, env=env, timeout=600))
    assert len({tuple(sorted(r["digests"].items())) for r in reports}) == 1, "ranks disagree bitwise"
    for r in reports:
        assert r["worst_rel"] < 0.05, r["worst_rel"]  # the sum, not a constant: close to the fp64 sum
        assert set(r["digests"]) == {"float32/4096", "float32/8192", "bfloat16/4096", "bfloat16/8192"}
        used = {alg for rows in r["served"].values() for _, _, alg in rows}
        assert used == {"one-shot", "two-shot"}, used
