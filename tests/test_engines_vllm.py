"""vLLM's own distributed layer with nvrar's plugin, on real processes: every rank runs under
.venv-engines/bin/python (scripts/engines_env.sh: vLLM 0.33.0 from its source distribution,
VLLM_TARGET_DEVICE=empty, on torch 2.13.0's CPU build) with VLLM_TARGET_DEVICE=cpu (vLLM's CPU
platform) and NVRAR_VLLM=1; vLLM's load_general_plugins() finds nvrar through the
vllm.general_plugins entry point, and vLLM's init_distributed_environment and
ensure_model_parallel_initialized build the groups. tensor_model_parallel_all_reduce is checked
bit for bit against gloo's all-reduce over the same ranks (integer-valued data) on the sizes and
dtypes of vLLM v0.33.0's tests/distributed/test_custom_all_reduce.py, odd sizes and decode
shapes; the input is unchanged (the out-of-place contract of vLLM's custom op); the serving
communicator is nvrar's and its stats show every call served by nvrar.

Skipped (with the reason) without .venv-engines; failed instead where NVRAR_ENGINES_REQUIRED=1."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import tempfile
from typing import Dict, List

import pytest

import _engines
import _netns
from _engines_tasks import ODD_CASES, VLLM_EAGER_CASES, VLLM_TEST_DTYPES, VLLM_TEST_SIZES
from _launch import WORKER, RankResult, assert_all_ok, describe, free_port, launch

pytestmark = pytest.mark.slow

NVRAR_CPU = "nvrar.integrations.vllm_communicators.NvrarCpuCommunicator"
ENV = {"VLLM_TARGET_DEVICE": "cpu", "NVRAR_VLLM": "1", "VLLM_PLUGINS": "nvrar",
       # no usage reports, no download of anything
       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
FULL_CASES = len(VLLM_TEST_SIZES) * len(VLLM_TEST_DTYPES) + len(VLLM_EAGER_CASES) + len(ODD_CASES) + 4


@pytest.fixture(autouse=True)
def _vllm_installed():
    _engines.need("vllm")


def vllm_launch(world: int, args: dict, env: Dict[str, str], timeout: float = 400) -> List[dict]:
    e = dict(ENV)
    e.update(env)
    return assert_all_ok(launch(world, "engines_vllm_tp", args, env=e, timeout=timeout, executable=_engines.PYTHON))


def check_tp(reports: List[dict], tp: int, nodes: int, cases: int = FULL_CASES) -> None:
    for rep in reports:
        assert rep["platform"] == "CpuPlatform", rep["platform"]
        assert rep["communicator"] == NVRAR_CPU, rep["communicator"]
        assert rep["cases"] == cases
        assert rep["wrong"] == [], f"rank {rep['rank']}: differs from gloo: {rep['wrong']}"
        st = rep["stats"][rep["tp_name"]]
        assert st["served_by_nvrar"] and st["why_not"] == "", st
        assert rep["mutated"] == [], f"rank {rep['rank']}: input changed: {rep['mutated']}"
        assert rep["custom_op_ok"], rep
        assert st["nvrar"] == rep["calls"] and st["native"] == 0, st  # every call served by nvrar
        assert st["world_size"] == tp and st["nodes"] == nodes and st["ranks_per_node"] == tp // nodes, st
        # Only the TP group is served; destroy_model_parallel() closed it.
        assert set(rep["stats"]) == {rep["tp_name"]} and rep["stats_after_destroy"] == {}, rep["stats"]


def test_the_sizes_are_those_of_vllms_custom_all_reduce_test():
    """VLLM_TEST_SIZES is vLLM v0.33.0's test_sizes (tests/distributed/test_custom_all_reduce.py)."""
    rng = random.Random(42)
    sizes = [rng.randint(1024, 2048 * 1024) for _ in range(8)]
    assert VLLM_TEST_SIZES == [v - v % 8 for v in sizes]


def test_tp2():
    check_tp(vllm_launch(2, {"tp": 2}, {}), tp=2, nodes=1)


def test_tp4_as_two_emulated_nodes():
    """TP 4 as 2 nodes of 2 ranks (NVRAR_RANKS_PER_NODE=2): nvrar's inter-node steps run."""
    check_tp(vllm_launch(4, {"tp": 4}, {"NVRAR_RANKS_PER_NODE": "2"}), tp=4, nodes=2)


def test_tp2_pp2():
    """TP 2 x PP 2: the two TP groups ([0, 1], [2, 3]) served by nvrar, the PP groups left to vLLM."""
    reports = vllm_launch(4, {"tp": 2, "pp": 2, "vllm_sizes": False}, {})
    check_tp(reports, tp=2, nodes=1, cases=len(ODD_CASES) + 4)
    for rep in reports:
        r = rep["rank"]
        assert rep["tp_ranks"] == [r - r % 2, r - r % 2 + 1] and rep["pp_ranks"] == [r % 2, r % 2 + 2], rep
        assert rep["pp_ok"] is True
        assert rep["pp_communicator"] == "NvrarCpuCommunicator"  # its class, but not served by nvrar


def test_2x2_across_namespace_hosts():
    """TP 4 on 2 network-namespace hosts x 2 ranks (tests/_netns.py): vLLM's groups over gloo on
    the hosts' network, nvrar's inter-node steps over UCX between the hosts; vLLM's shared-memory
    kernel stays off across hosts."""
    why = _netns.why_not()
    if why is not None:
        _engines.skip(why)
    try:
        import libucx  # noqa: F401
    except ImportError:
        pass  # the ranks' environment is .venv-engines, which has it ('.[ucx]')
    tmp = tempfile.mkdtemp(prefix="nvrar-engines-hosts-")
    port = free_port()
    secret = secrets.token_hex(16)
    try:
        hosts = _netns.Hosts(2, tmp)
        with hosts:
            for h in range(2):
                ranks = []
                for local in range(2):
                    r = 2 * h + local
                    env = {k: v for k, v in os.environ.items()
                           if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")}
                    env.update(ENV)
                    env.update({"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(local),
                                "MASTER_ADDR": hosts.addr(0), "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "eth0",
                                "VLLM_HOST_IP": hosts.addr(h), "NVRAR_SESSION_SECRET": secret,
                                "PYTHONUNBUFFERED": "1", "NVRAR_TUNING_FILE": os.path.join(tmp, "none.json")})
                    ranks.append({"argv": [_engines.PYTHON, WORKER, "engines_vllm_tp", json.dumps({"tp": 4}),
                                           os.path.join(tmp, f"rank{r}.json")],
                                  "env": env, "log": os.path.join(tmp, f"rank{r}.log")})
                hosts.start(h, ranks)
            codes = hosts.wait(400)
        results = []
        for r in range(4):
            path = os.path.join(tmp, f"rank{r}.json")
            rep = json.load(open(path)) if os.path.exists(path) else None
            log = open(os.path.join(tmp, f"rank{r}.log")).read() if os.path.exists(os.path.join(tmp, f"rank{r}.log")) else ""
            ok = rep is not None and "exception" not in rep and codes[r // 2] is not None
            results.append(RankResult(r, 0 if ok else 1, "", log[-4000:], rep))
        reports = assert_all_ok(results)
        assert hosts.exists() == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    check_tp(reports, tp=4, nodes=2)
    assert [rep["hostname"] for rep in reports] == ["nvrhost0", "nvrhost0", "nvrhost1", "nvrhost1"], describe(results)


def test_cuda_communicator_selected_through_both_entry_points():
    """NvrarCudaCommunicator is importable against vLLM's own CudaCommunicator, and both entry
    points hand it out for vLLM's CUDA platform (no GPU here: see the task's docstring)."""
    res = assert_all_ok(launch(1, "engines_vllm_cuda_selection", {}, env=dict(ENV), timeout=300,
                               executable=_engines.PYTHON))[0]
    expected = "nvrar.integrations.vllm_communicators.NvrarCudaCommunicator"
    assert res["expected"] == expected
    assert res["via_general"] == expected and res["general_class"] == expected and res["general_is_cuda_subclass"], res
    assert res["platform"] == "nvrar.integrations.vllm_platforms.NvrarCudaPlatform" and res["platform_is_cuda_subclass"], res
    assert res["via_platform"] == expected, res


def test_plugins_dormant_in_vllm_without_the_switch():
    """With vLLM installed and NVRAR_VLLM unset, vLLM's loader runs nvrar's plugin and vLLM keeps
    its own CpuCommunicator."""
    code = ("from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
            "from vllm.platforms import current_platform\nprint(current_platform.get_device_communicator_cls())")
    env = {k: v for k, v in os.environ.items() if k not in ("NVRAR_VLLM", "VLLM_PLUGINS")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1"})
    r = subprocess.run([_engines.PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"
