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
        assert rep["inplace_op_returns_its_tensor"]  # issue 12: it returned None
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


# -- the "nvrar" torch.distributed backend, patch() over functional collectives and DTensor ------

def test_torch_internals_nvrar_relies_on():
    """What nvrar/_torch_backend.py and patch() rely on in torch.distributed; a torch release that
    changes one of these fails here first, by name."""
    import inspect

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import (_register_process_group, _resolve_process_group,  # noqa: F401
                                            _unregister_process_group)

    import nvrar.torch as nt

    assert "nvrar" in dist.Backend.backend_list and dist.Backend._plugins["NVRAR"].extended_api
    assert dist.Backend.backend_capability["nvrar"] == ["cpu", "cuda"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # registering did not take cpu over
    helper = inspect.getsource(c10d._new_process_group_helper)
    # a creator returning a ProcessGroup becomes the group; the extended API passes these fields
    assert "issubclass(type(backend_class), ProcessGroup)" in helper and "pg = backend_class" in helper
    for field in ("store", "group_rank", "group_size", "timeout", "group_id", "global_ranks_in_group"):
        assert f"dist_backend_opts.{field} =" in helper, field
    # Python subclasses of ProcessGroup and Work are reached from C++ (pybind trampolines)
    assert issubclass(nt.NvrarProcessGroup, dist.ProcessGroup) and issubclass(nt.Work, dist.Work)
    for method in ("_register_backend", "_set_default_backend", "_get_backend", "_device_types", "_set_group_name"):
        assert hasattr(dist.ProcessGroup, method), method
    # patch(): the per-group tables it aliases, and the registry the functional collectives resolve
    for table in nt._ALIAS_TABLES + ("pg_names",):
        assert isinstance(getattr(c10d._world, table), dict), table
    for op in ("all_reduce", "all_reduce_", "all_reduce_coalesced"):
        assert "group_name)" in str(getattr(torch.ops._c10d_functional, op).default._schema), op
    # issue 12: the in-place custom op returns its tensor
    assert str(torch.ops.nvrar.all_reduce_.default._schema).endswith("-> Tensor(a!)")


def test_nvrar_backend_4_ranks_dtensor_functional_and_every_other_collective():
    reports = assert_all_ok(launch(4, "backend", {"compile": "aot_eager"}, timeout=500))
    for rank, rep in enumerate(reports):
        assert rep["type"] == "NvrarProcessGroup" and rep["backend"] == "nvrar" and rep["mesh_group_is_world"], rep
        d = rep["dtensor"]
        assert d["eager_equal_gloo"] and d["eager_equal_unsharded"] and d["nonzero"] and d["compiled_equal"], d
        assert d["eager_delta"] == 3 and d["compiled_delta"] == 3, d  # one Partial -> Replicate per forward
        assert rep["functional"] == {"values": True, "nvrar_delta": 4, "native_delta": 2}, rep["functional"]
        assert rep["native_values"] and rep["native_delta"] == 2, rep
        assert all(rep["others"].values()), rep["others"]
        assert len(rep["others"]) == 7
        if rank < 2:
            assert rep["sub"] == ["NvrarProcessGroup", True, {"nvrar": 1, "native": 0}], rep["sub"]
        assert rep["mesh2_type"] == "NvrarProcessGroup"
        m2 = rep["mesh2_dtensor"]
        assert m2["eager_equal_gloo"] and m2["eager_equal_unsharded"] and m2["eager_delta"] == 3, m2
        w = rep["work"]
        assert w["ok_type"] == "Work" and w["ok"] == [True, True, True, True, True] and w["future"], w
        assert w["failed"] == [True, False, "NvrarError"], w
        assert "closed" in w["failed_wait"] and "closed" in w["failed_sync"], w
        assert w["after_reset"], w
        assert rep["nt_all_reduce_counted_once"] == 1


def test_nvrar_backend_compiled_with_inductor_2_ranks():
    reports = assert_all_ok(launch(2, "backend", {"compile": "inductor", "backend_string": "cpu:nvrar"},
                                   timeout=500))
    for rep in reports:
        d = rep["dtensor"]
        assert rep["backend"] == "cpu:nvrar" or rep["backend"] == "nvrar", rep["backend"]
        assert d["compiled_equal"] and d["compiled_delta"] == 3 and d["eager_equal_gloo"], d
        assert all(rep["others"].values()), rep["others"]


def test_patch_routes_dtensor_and_functional_collectives():
    reports = assert_all_ok(launch(4, "patch_dtensor", {"compile": "aot_eager"}, timeout=500))
    for rep in reports:
        assert rep["outside"]["eager_delta"] == 0 and rep["outside"]["eager_equal_unsharded"], rep["outside"]
        assert rep["registry_swapped"] == "NvrarProcessGroup" and rep["registry_restored"], rep
        inside = rep["inside"]
        assert inside["eager_delta"] == 3 and inside["compiled_delta"] == 3, inside
        assert inside["eager_equal_unsharded"] and inside["compiled_equal"], inside
        assert rep["functional"] == {"values": True, "nvrar_delta": 4, "native_delta": 2}, rep["functional"]
        assert rep["after_exit_delta"] == 0


def test_group_across_hosts_served_by_nvrar_and_without_ucx_falls_back_naming_the_extra():
    pytest.importorskip("libucx", reason="UCX is not installed (pip install 'nvrar[ucx]')")
    reports = assert_all_ok(launch(4, "hosts", {}, env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=300))
    if any("skip" in r for r in reports):
        pytest.skip(next(r["skip"] for r in reports if "skip" in r))
    assert len({r["host"] for r in reports}) == 2
    for rep in reports:
        # Without UCX: gloo serves the group across hosts, on every rank, with the warning.
        assert rep["world_value"] and rep["world_stats"] == {"nvrar": 0, "native": 1} and rep["warned"], rep
        # With UCX: nvrar serves it (2 hosts x 2 ranks), and each host's sub-group.
        assert rep["across_value"] and rep["across_stats"] == {"nvrar": 1, "native": 0}, rep
        assert rep["sub_value"] and rep["sub_stats"] == {"nvrar": 1, "native": 0}, rep
