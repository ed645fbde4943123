"""What the engine tests (tests/test_engines*.py) share: the engines' environment
(.venv-engines, built by scripts/engines_env.sh), whether an engine is installed there, and the
skip that becomes a failure where NVRAR_ENGINES_REQUIRED=1 (.ci/run sets it after building the
environment, so that an engine test that cannot run fails CI instead of passing as a skip)."""

from __future__ import annotations

import functools
import os
import subprocess
from typing import Dict, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VENV = os.environ.get("ENGINES_VENV") or os.path.join(ROOT, ".venv-engines")
PYTHON = os.path.join(VENV, "bin", "python")
REQUIRED = os.environ.get("NVRAR_ENGINES_REQUIRED") == "1"
VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}


@functools.lru_cache(maxsize=None)
def installed() -> Dict[str, str]:
    """{distribution: version} of the engines (and torch, nvrar) in .venv-engines; {} without it."""
    if not os.path.exists(PYTHON):
        return {}
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for d in ('vllm', 'sglang', 'torch', 'nvrar'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    r = subprocess.run([PYTHON, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return {}
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


def why_not(engine: str) -> Optional[str]:
    """None when ``engine`` is installed in .venv-engines at the version the tests are for."""
    if not os.path.exists(PYTHON):
        return f"no {os.path.relpath(VENV, ROOT)} (build it with `bash scripts/engines_env.sh`)"
    have = installed()
    if "nvrar" not in have:
        return f"nvrar is not installed in {os.path.relpath(VENV, ROOT)} (rerun scripts/engines_env.sh)"
    got = have.get(engine)
    if got is None:
        return f"{engine} is not installed in {os.path.relpath(VENV, ROOT)} (rerun scripts/engines_env.sh)"
    if got.split("+")[0] != VERSIONS[engine]:
        return f"{engine} {got} in {os.path.relpath(VENV, ROOT)}, the tests are for {VERSIONS[engine]}"
    return None


def skip(reason: str) -> None:
    """pytest.skip, or pytest.fail where NVRAR_ENGINES_REQUIRED=1."""
    if REQUIRED:
        pytest.fail(f"NVRAR_ENGINES_REQUIRED=1, but this engine test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def need(engine: str) -> None:
    reason = why_not(engine)
    if reason is not None:
        skip(reason)
