"""SGLang's own distributed layer with nvrar's plugin, on real processes: every rank runs under
.venv-engines/bin/python (scripts/engines_env.sh: SGLang 0.5.23 installed without its
dependencies, imported with torch 2.13.0's CPU build; tests/_engines_sglang_env.py names the
imports stubbed because they cannot load there) with NVRAR_SGLANG=1. SGLang's load_plugins()
finds nvrar through the sglang.srt.plugins entry point and applies its hooks with SGLang's own
HookRegistry to SGLang's own GroupCoordinator; SGLang's init_distributed_environment and
initialize_model_parallel build the groups. Checked bit for bit against gloo's all-reduce over
the same ranks (integer-valued data): tensor_model_parallel_all_reduce on CPU tensors (in place,
as SGLang's own CPU path) and the out-of-place chain (methods "auto" and "nvrar", the input
unchanged), with every call served by nvrar.

Skipped (with the reason) without .venv-engines; failed instead where NVRAR_ENGINES_REQUIRED=1."""

from __future__ import annotations

from typing import List

import pytest

import _engines
from _launch import assert_all_ok, launch

pytestmark = pytest.mark.slow

ENV = {"NVRAR_SGLANG": "1", "SGLANG_PLUGINS": "nvrar", "HF_HUB_OFFLINE": "1"}
HOOKED = sorted(f"sglang.srt.distributed.parallel_state.GroupCoordinator.{m}"
                for m in ("__init__", "_resolve_outplace_all_reduce_method", "_all_reduce_out_place", "all_reduce",
                          "destroy"))


@pytest.fixture(autouse=True)
def _sglang_installed():
    _engines.need("sglang")


def sglang_launch(world: int, env: dict) -> List[dict]:
    e = dict(ENV)
    e.update(env)
    return assert_all_ok(launch(world, "engines_sglang_tp", {}, env=e, timeout=400, executable=_engines.PYTHON))


def check(reports: List[dict], world: int, nodes: int) -> None:
    for rep in reports:
        assert rep["hooked"] == HOOKED, rep["hooked"]
        assert rep["tp_ranks"] == list(range(world))
        assert rep["wrong"] == [], f"rank {rep['rank']}: differs from gloo: {rep['wrong']}"
        assert rep["not_in_place"] == [], rep["not_in_place"]  # SGLang's CPU path reduces in place
        assert rep["outplace_ok"], rep
        assert set(rep["resolved"]) == {"nvrar"}, rep["resolved"]
        st = rep["stats"][rep["tp_name"]]
        assert st["served_by_nvrar"] and st["native"] == 0, st
        assert st["nvrar"] == rep["cases"] + 2 * 5, st
        assert st["world_size"] == world and st["nodes"] == nodes, st
        assert rep["stats_after_destroy"] == {}, rep["stats_after_destroy"]


def test_sglang_tp2():
    reports = sglang_launch(2, {})
    check(reports, 2, 1)


def test_sglang_tp4_as_two_emulated_nodes():
    check(sglang_launch(4, {"NVRAR_RANKS_PER_NODE": "2"}), 4, 2)
