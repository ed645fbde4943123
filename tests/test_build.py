"""The build: on a machine with nvcc, the GPU executor must have been compiled and linked (CI has
nvcc and no GPU: this is where a broken CUDA build fails it)."""

import os
import shutil
import subprocess

import pytest

import nvrar


def nvcc_present() -> bool:
    if os.environ.get("NVRAR_CUDA", "").strip() == "0":
        return False
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return shutil.which("nvcc") is not None or any(r and os.path.isfile(os.path.join(r, "bin", "nvcc")) for r in roots)


def test_build_info_contract():
    info = nvrar.build_info()
    assert {"cuda", "nvshmem_version", "cuda_archs"} <= set(info)
    assert info["cpu_executor"] is True
    assert isinstance(info["cuda"], bool)


@pytest.mark.skipif(not nvcc_present(), reason="no nvcc on this machine: the GPU executor is not built here")
def test_gpu_executor_is_built_where_nvcc_is():
    info = nvrar.build_info()
    assert info["cuda"] is True, info["cuda_error"]
    assert info["nvshmem_version"] and {80, 90} <= set(info["cuda_archs"])
    # The install requirement pins the NVSHMEM wheel the module was built against (setup.py).
    assert info["nvshmem_library_version"] == info["nvshmem_version"], info


def test_nvshmem_version_mismatch_is_a_clear_error():
    """Another minor version of NVSHMEM's host library is refused when the module loads, with both
    versions and the fix named (not a crash inside nvshmem_init)."""
    from nvrar._gpu import version_mismatch

    assert version_mismatch("3.4.5", "3.4.5") is None
    assert version_mismatch("3.4.5", "3.4.7") is None  # a patch release
    for loaded in ("3.8.0", "3.3.9", "4.4.5"):
        why = version_mismatch("3.4.5", loaded)
        assert why and "3.4.5" in why and loaded in why and "nvidia-nvshmem-cu13==3.4.5" in why, why


@pytest.mark.skipif(not nvcc_present(), reason="no nvcc on this machine: the GPU executor is not built here")
def test_gpu_module_exports_only_its_init():
    """Our NVSHMEM device state and static cudart stay private to the module."""
    from nvrar import _gpu

    mod, err = _gpu.load()
    assert mod is not None, err
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not installed")
    out = subprocess.run([nm, "-D", "--defined-only", mod.__file__], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert names == ["PyInit__cuda"], names


def test_gpu_communicator_without_gpu_is_a_clear_error():
    info = nvrar.build_info()
    if info["gpus"]:
        pytest.skip("a GPU is present")
    with pytest.raises(nvrar.NvrarError, match="device='cuda'"):
        nvrar.Communicator(device="cuda")
