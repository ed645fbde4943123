"""nvrar.torch in real torch.distributed (gloo) process groups: the TP block, torch.compile,
patch(), rank-consistent selection, the tuning table's window, and `nvrar tune`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _launch import assert_all_ok, launch

pytest.importorskip("torch")


def test_tp_block_identical_with_nvrar_and_native():
    reports = assert_all_ok(launch(4, "tp", {"hidden": 256, "layers": 2}))
    for rep in reports:
        assert rep["largest"]["torch.bfloat16"] < 256 and rep["largest"]["torch.float32"] < 2 ** 24, rep
        assert rep["identical"] and all(rep["identical"]), rep
        assert rep["calls"]["nvrar"] == 2 * 2 * 3 * 2 and rep["calls"]["native"] == 0


@pytest.mark.parametrize("world,backend", [(4, "aot_eager"), (2, "inductor")])
def test_torch_compile_fullgraph(world, backend):
    reports = assert_all_ok(launch(world, "compile", {"backend": backend}, timeout=400))
    for rep in reports:
        assert rep["inplace"] and rep["functional"], rep
        assert rep["product_async"], rep  # PRODUCT went native, async_op gave a work handle
        assert rep["calls"]["nvrar"] >= 3  # eager reference + both compiled functions ran nvrar


def test_patch_routes_unchanged_code():
    reports = assert_all_ok(launch(4, "patch", {}))
    for rep in reports:
        assert rep["inside_is_patched"] and rep["nested_still_patched"]
        assert rep["restored"] and rep["restored_after_decorator"]
        assert rep["values_ok"]
        assert rep["nvrar_delta"] == 2      # float32 sum x2 (outer + nested)
        assert rep["native_delta"] == 2     # float64, PRODUCT (before the string-op calls)
        assert rep["after_decorator"] == 1
        assert rep["async_ok"]
        assert rep["string_op_native_ok"]
        assert rep["bad_op"] and "median" in rep["bad_op"]


def write_table(path, world, G, buckets):
    with open(path, "w") as f:
        json.dump({"format": "nvrar-tuning-1", "tables": [
            {"device": "cpu", "world_size": world, "ranks_per_node": G, "buckets": buckets}]}, f)


WINDOW = [{"max_bytes": 8192, "choice": "native"}, {"max_bytes": 1 << 20, "choice": "two-shot"},
          {"max_bytes": None, "choice": "native"}]


def test_selection_is_rank_consistent_and_falls_back_outside_the_window(tmp_path):
    path = tmp_path / "tuning.json"
    write_table(path, 4, 4, WINDOW)
    calls = [4096, 65536, 4 << 20]  # below, inside, above the window
    reports = assert_all_ok(launch(4, "select", {"calls": calls}, env={"NVRAR_TUNING_FILE": str(path)}))
    grids = {json.dumps(r["grid"]) for r in reports}
    assert len(grids) == 1, "ranks decided differently"
    grid = reports[0]["grid"]
    assert "two-shot" in grid and "native" in grid
    for rep in reports:
        assert rep["window"] == [8193, 1 << 20]
        assert rep["nvrar_delta"] == 1 and rep["native_delta"] == 2
        assert not rep["warnings"]


def test_different_tables_on_ranks_fall_back_to_the_builtin_policy_everywhere(tmp_path):
    good, other = tmp_path / "a.json", tmp_path / "b.json"
    write_table(good, 2, 2, WINDOW)
    write_table(other, 2, 2, [{"max_bytes": None, "choice": "one-shot"}])
    reports = assert_all_ok(launch(2, "select", {}, per_rank_env=[{"NVRAR_TUNING_FILE": str(good)},
                                                                   {"NVRAR_TUNING_FILE": str(other)}]))
    assert reports[0]["grid"] == reports[1]["grid"]
    for rep in reports:
        assert rep["window"] is None
        assert any("different tuning tables" in w for w in rep["warnings"])
        assert "one-shot" not in rep["grid"] and "two-shot" not in rep["grid"]


def test_nvrar_tune_writes_a_table_that_nvrar_torch_uses(tmp_path):
    out = tmp_path / "t.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_osc="^ucx")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-m", "nvrar.cli", "tune", "--ranks", "2", "--min-bytes", "8K",
                          "--max-bytes", "64K", "--iters", "10", "--warmup", "2", "-o", str(out)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    table = data["tables"][0]
    assert (table["device"], table["world_size"], table["ranks_per_node"]) == ("cpu", 2, 2)
    assert table["buckets"][-1] == {"max_bytes": None, "choice": "native"}
    assert {r["backend"] for r in table["measured"]["rows"]} == {"nvrar", "gloo"}
    reports = assert_all_ok(launch(2, "select", {"calls": [8192]}, env={"NVRAR_TUNING_FILE": str(out)}))
    assert reports[0]["window"] is not None and reports[0]["grid"] == reports[1]["grid"]
    print(res.stdout)


def test_tuning_table_validation():
    from nvrar.selector import Table

    good = [{"max_bytes": 1024, "choice": "one-shot"}, {"max_bytes": None, "choice": "native"}]
    assert Table("cpu", 2, 2, good).choice(1000) == "one-shot"
    bad = [
        [],
        [{"max_bytes": -5, "choice": "auto"}],
        [{"max_bytes": 10, "choice": "auto"}, {"max_bytes": 10, "choice": "native"}],
        [{"max_bytes": 1.9, "choice": "one-shot"}],
        [{"max_bytes": True, "choice": "one-shot"}],
        [{"max_bytes": None, "choice": "auto"}, {"max_bytes": 5, "choice": "native"}],
        [{"max_bytes": 5, "choice": "four-shot"}],
        [{"limit": 5, "choice": "auto"}],
        ["not a dict"],
    ]
    for buckets in bad:
        with pytest.raises(ValueError):
            Table("cpu", 2, 2, buckets)


def test_bad_tuning_file_on_one_rank_does_not_hang_the_others(tmp_path):
    good, broken = tmp_path / "a.json", tmp_path / "b.json"
    write_table(good, 2, 2, WINDOW)
    broken.write_text(json.dumps({"format": "nvrar-tuning-1", "tables": [{"device": "cpu", "world_size": 2,
                                                                            "ranks_per_node": 2}]}))
    reports = assert_all_ok(launch(2, "select", {}, per_rank_env=[{"NVRAR_TUNING_FILE": str(good)},
                                                                   {"NVRAR_TUNING_FILE": str(broken)}], timeout=120))
    assert reports[0]["grid"] == reports[1]["grid"]
    assert all(r["window"] is None for r in reports)


def test_nvrar_tune_rejects_bad_arguments(tmp_path):
    res = subprocess.run([sys.executable, "-m", "nvrar.cli", "tune", "--iters", "0"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 2 and "--iters" in res.stderr
