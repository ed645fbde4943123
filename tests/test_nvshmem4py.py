"""nvshmem4py beside nvrar, without a GPU (CI): the extra's metadata follows the build, the installed
set is consistent (pip check), both import in one process and agree on the NVSHMEM host library and
its version, and Communicator(device="cuda") on a host without a GPU raises NvrarError naming the
cause on every rank, with nvshmem4py installed and imported first, and the process goes on (no
NVSHMEM initialization is ever reached: without a GPU it would end the process). tests/gpu runs
the GPU side (join, initialization through nvshmem4py, zero-copy nvshmem4py tensors)."""

import importlib.metadata as md
import json
import os
import shutil
import site
import subprocess
import sys

import pytest

import nvrar
from nvrar import _gpu, _setup
from nvrar.errors import NvrarError

from _launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
N4P = _gpu.nvshmem4py_version()
needs_n4p = pytest.mark.skipif(N4P is None, reason="nvshmem4py is not installed (pip install '.[nvshmem4py]')")
INFO = nvrar.build_info()
needs_cuda_build = pytest.mark.skipif(not INFO["cuda"], reason=f"needs the GPU executor built: {INFO['cuda_error']}")


def _installed_requires():
    """nvrar's requirements as installed (its dist-info in site-packages; not a nvrar.egg-info that a
    build left in the source tree, which the current directory would put first)."""
    dists = list(md.distributions(name="nvrar", path=site.getsitepackages()))
    assert dists, f"nvrar is not installed in {site.getsitepackages()}"
    return dists[0].requires or []


def _extra_requirements(extra):
    return [r for r in _installed_requires() if f'extra == "{extra}"' in r.replace("'", '"')]


def test_extra_follows_the_build():
    """The nvshmem4py extra names nvshmem4py-cu13, and pins the NVSHMEM wheel exactly where the GPU
    executor was built (the same pin as the dependency), and only there."""
    extra = _extra_requirements("nvshmem4py")
    assert any(r.startswith("nvshmem4py-cu13") for r in extra), extra
    pins = [r for r in extra if r.startswith("nvidia-nvshmem-cu13")]
    deps = [r for r in _installed_requires() if r.startswith("nvidia-nvshmem-cu13") and "extra ==" not in r]
    if INFO["nvshmem_version"]:
        assert len(pins) == 1 and f"=={INFO['nvshmem_version']}" in pins[0], (pins, INFO)
        assert len(deps) == 1 and f"=={INFO['nvshmem_version']}" in deps[0], deps
    else:
        assert pins == [] and deps == [], (pins, deps)
    # the test extra carries it, so that the suite (and CI) runs with nvshmem4py installed
    assert any(r.startswith("nvshmem4py-cu13") for r in _extra_requirements("test"))


@needs_n4p
def test_installed_set_is_consistent():
    """What is installed beside nvrar (torch, nvshmem4py, its cuda-python stack) has no broken
    requirement, and the NVSHMEM wheel is the one nvrar was built against."""
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md.version("torch")  # installed beside it
    if INFO["nvshmem_version"]:
        assert md.version("nvidia-nvshmem-cu13") == INFO["nvshmem_version"]
    assert INFO["nvshmem4py_version"] == N4P == md.version("nvshmem4py-cu13")


_BOTH = r"""
import json, os, sys
import torch, nvrar
from nvrar import _gpu
import nvshmem.core as core
info = nvrar.build_info()
path, version = _gpu.nvshmem4py_library(core)
mod, err = _gpu.load()
print(json.dumps({"info": info, "n4p_path": path, "n4p_version": version, "mapped": _gpu.mapped_host_libraries(),
                  "mismatch": _gpu.library_mismatch(mod, core) if mod is not None else None,
                  "ours": os.path.realpath(mod.nvshmem_library_path()) if mod is not None else None,
                  "status": int(core.init_status()), "n4p_initialized": _gpu.nvshmem4py_initialized(core)}))
"""


@needs_n4p
def test_both_import_in_one_process_and_agree():
    proc = subprocess.run([sys.executable, "-c", _BOTH], capture_output=True, text=True, timeout=180, cwd=HERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["info"]["nvshmem4py_version"] == N4P
    assert r["status"] == 0 and r["n4p_initialized"] is False, r  # importing initializes nothing
    assert len(r["mapped"]) == 1 and r["mapped"][0] == r["n4p_path"], r
    if r["info"]["cuda"]:
        assert r["ours"] == r["n4p_path"], r
        assert r["n4p_version"] == r["info"]["nvshmem_library_version"] == r["info"]["nvshmem_version"], r
        assert r["mismatch"] is None, r["mismatch"]
    else:
        assert r["n4p_version"] == md.version("nvidia-nvshmem-cu13"), r


_TWO_COPIES = r"""
import json, os, sys
import nvshmem.core as core
core.get_version()                       # nvshmem4py loads the wheel's host library first
os.environ["NVSHMEM_HOME"] = sys.argv[1]  # nvrar is pointed at a copy of it
from nvrar import _gpu
mod, err = _gpu.load()
print(json.dumps({"err": err, "mismatch": _gpu.library_mismatch(mod, core) if mod is not None else None,
                  "mapped": _gpu.mapped_host_libraries()}))
"""


@needs_n4p
@needs_cuda_build
def test_two_host_library_files_are_refused(tmp_path):
    """nvrar pointed (NVSHMEM_HOME) at another file than the one nvshmem4py loaded: two NVSHMEM
    states in one process, refused with both paths named."""
    wheel_lib = _gpu.nvshmem4py_library(_gpu.nvshmem4py()[0])[0]
    (tmp_path / "lib").mkdir()
    shutil.copy(wheel_lib, tmp_path / "lib" / "libnvshmem_host.so.3")
    proc = subprocess.run([sys.executable, "-c", _TWO_COPIES, str(tmp_path)], capture_output=True, text=True,
                          timeout=180, cwd=HERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["err"] is None, r
    assert len(r["mapped"]) == 2, r
    assert r["mismatch"] and str(tmp_path) in r["mismatch"] and wheel_lib in r["mismatch"], r


def test_ranks_must_come_to_nvshmem_alike():
    """The exchanged verdicts: all ranks join an NVSHMEM in force, or all initialize it the same way."""
    _setup._check_modes([{"mode": "join"}] * 3)
    _setup._check_modes([{"mode": "nvshmem4py"}] * 2)
    with pytest.raises(NvrarError, match=r"ranks \[0\] have NVSHMEM initialized already; ranks \[1, 2\] would "
                                         r"initialize it through nvshmem4py"):
        _setup._check_modes([{"mode": "join"}, {"mode": "nvshmem4py"}, {"mode": "nvshmem4py"}])
    with pytest.raises(NvrarError, match=r"ranks \[1\] would initialize it without nvshmem4py"):
        _setup._check_modes([{"mode": "nvshmem4py"}, {"mode": "nvrar"}])


@needs_n4p
def test_cuda_communicator_without_gpu_is_a_clear_error_on_every_rank():
    """2 ranks, nvshmem4py imported first: Communicator(device="cuda") raises NvrarError naming the
    cause on both, NVSHMEM is never initialized (status 0, nvshmem4py's flag unset), and each process
    goes on to a CPU all-reduce."""
    results = launch(2, "gpu_n4p_no_gpu", {}, timeout=240)
    for r in results:
        assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    reports = [r.report for r in results]
    for rep in reports:
        assert rep["raised"] == "NvrarError", rep
        msg = rep["message"]
        assert "device='cuda'" in msg, msg
        if INFO["cuda"]:
            assert "needs a CUDA device" in msg, msg
        else:
            assert "built without the GPU executor" in msg, msg
        assert rep["status_after"] == 0 and rep["n4p_initialized"] is False, rep
        assert rep["cpu_sum"] == 3.0, rep  # ranks 0 and 1 contribute 1 and 2
