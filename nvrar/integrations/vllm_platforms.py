"""nvrar's vLLM platforms (``NVRAR_VLLM=platform``; nvrar.integrations.vllm.platform names them):
vLLM's CPU and CUDA platforms whose device communicator is nvrar's. Each class is made on first
use, so that naming the CPU one never imports vLLM's CUDA platform. Imported only by vLLM."""

from __future__ import annotations

from typing import Any, Dict

from .vllm import communicator_for

__all__ = ["NvrarCpuPlatform", "NvrarCudaPlatform"]  # noqa: F822 (made on first use: module __getattr__)

_BASES = {"NvrarCpuPlatform": ("vllm.platforms.cpu", "CpuPlatform"),
          "NvrarCudaPlatform": ("vllm.platforms.cuda", "CudaPlatform")}
_made: Dict[str, type] = {}


def _make(name: str) -> type:
    import importlib

    module, base_name = _BASES[name]
    base = getattr(importlib.import_module(module), base_name)
    own = communicator_for(base.get_device_communicator_cls())

    def get_device_communicator_cls(cls: Any) -> str:
        return own

    cls = type(name, (base,), {"get_device_communicator_cls": classmethod(get_device_communicator_cls),
                               "__module__": __name__, "__doc__": f"vLLM's {base_name} with nvrar's device communicator."})
    return cls


def __getattr__(name: str) -> Any:
    if name in _BASES:
        if name not in _made:
            _made[name] = _make(name)
        return _made[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
