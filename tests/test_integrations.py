"""The engine plugins (nvrar/integrations, docs/engines.md) where no engine is installed: dormant by
default, a wrong switch refused by name, no engine imported by nvrar, the entry points the engines
look up declared by the installed distribution. Runs against vLLM and SGLang themselves need their
own environment (docs/engines.md, "Status of testing")."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from nvrar import env

ENGINE_MODULES = ("vllm", "sglang")
ENTRY_POINTS = {
    "vllm.general_plugins": "nvrar.integrations.vllm:register",
    "vllm.platform_plugins": "nvrar.integrations.vllm:platform",
    "sglang.srt.plugins": "nvrar.integrations.sglang:register",
}


def run_py(code: str, **extra_env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("NVRAR_VLLM", "NVRAR_SGLANG")}
    e.update(extra_env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_dormant_by_default_and_no_engine_imported():
    r = run_py(
        "import sys, json\n"
        "import nvrar, nvrar.integrations\n"
        "from nvrar.integrations import vllm, sglang, _common\n"
        "vllm.register(); p = vllm.platform(); sglang.register()\n"
        "print(json.dumps({'platform': p, 'vllm': vllm.enabled(), 'sglang': sglang.enabled(),\n"
        "  'stats': [vllm.stats(), sglang.stats()],\n"
        "  'engines': sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang'))}))\n")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"platform": None, "vllm": "", "sglang": False, "stats": [{}, {}], "engines": []}, got


@pytest.mark.parametrize("value", ["0", "off", "false", ""])
def test_off_spellings_leave_the_engines_alone(value):
    r = run_py("from nvrar.integrations import vllm, sglang\n"
               "vllm.register(); sglang.register(); print(vllm.enabled() == '' and not sglang.enabled())",
               NVRAR_VLLM=value, NVRAR_SGLANG=value)
    assert r.returncode == 0 and r.stdout.strip() == "True", (r.stdout, r.stderr)


@pytest.mark.parametrize("var,module,value", [("NVRAR_VLLM", "vllm", "platfrom"), ("NVRAR_VLLM", "vllm", "2"),
                                              ("NVRAR_SGLANG", "sglang", "platform"), ("NVRAR_SGLANG", "sglang", "yes-please")])
def test_a_wrong_switch_is_refused_by_name(var, module, value):
    r = run_py(f"from nvrar.integrations import {module}\n{module}.register()", **{var: value})
    assert r.returncode != 0
    assert "ValueError" in r.stderr and var in r.stderr and repr(value.lower()) in r.stderr, r.stderr


@pytest.mark.parametrize("var,value,module,engine", [("NVRAR_VLLM", "1", "vllm", "vllm"),
                                                     ("NVRAR_VLLM", "platform", "vllm", "vllm"),
                                                     ("NVRAR_SGLANG", "1", "sglang", "sglang")])
def test_enabled_without_the_engine_fails_loudly(var, value, module, engine):
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here: this test is about its absence")
    call = "platform()" if value == "platform" else "register()"
    r = run_py(f"from nvrar.integrations import {module}\n{module}.{call}", **{var: value})
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr and engine in r.stderr, r.stderr


def test_the_installed_distribution_declares_the_entry_points():
    for group, target in ENTRY_POINTS.items():
        found = {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}
        assert "nvrar" in found, f"no entry point nvrar in {group}: {sorted(found)}"
        assert found["nvrar"].value == target
        assert callable(found["nvrar"].load())


def test_communicator_and_platform_names():
    from nvrar.integrations import vllm

    for theirs, ours in vllm.COMMUNICATORS.items():
        assert vllm.communicator_for(theirs) == ours
        module, _, name = ours.rpartition(".")
        assert module == "nvrar.integrations.vllm_communicators" and name.startswith("Nvrar")
    assert vllm.communicator_for("some.other.Communicator") == "some.other.Communicator"
    for ours in vllm.PLATFORMS.values():
        assert ours.startswith("nvrar.integrations.vllm_platforms.Nvrar")


def test_switches_are_registered_and_documented():
    names = set(env.VARIABLES)
    assert {"NVRAR_VLLM", "NVRAR_SGLANG"} <= names
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "engines.md")) as f:
        text = f.read()
    for name in ("NVRAR_VLLM", "NVRAR_SGLANG", *ENTRY_POINTS, *ENTRY_POINTS.values()):
        assert name in text, name


@pytest.mark.slow
def test_the_wheel_ships_the_plugins_and_their_entry_points(tmp_path):
    """`pip wheel --no-deps .` (the CPU executor only, NVRAR_CUDA=0, to keep it short): the wheel
    holds every nvrar.integrations module and declares the three entry points, each named nvrar."""
    import configparser
    import zipfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NVRAR_CUDA="0", NVRAR_UCX="0")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), root],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = set(z.namelist())
        (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(eps).decode()
    source = os.path.join(root, "nvrar", "integrations")
    modules = sorted(f for f in os.listdir(source) if f.endswith(".py"))
    assert {"__init__.py", "_common.py", "vllm.py", "vllm_communicators.py", "vllm_platforms.py", "sglang.py"} <= set(modules)
    missing = [m for m in modules if f"nvrar/integrations/{m}" not in names]
    assert missing == [], f"not in {wheel}: {missing}"
    parser = configparser.ConfigParser()
    parser.read_string(text)
    for group, target in ENTRY_POINTS.items():
        assert parser.has_section(group), f"{group} not in the wheel's entry_points.txt:\n{text}"
        assert parser.get(group, "nvrar") == target
