"""vLLM plugins: vLLM's tensor-parallel all-reduce served by nvrar, without patching vLLM.

Two entry points, both named ``nvrar`` (pyproject.toml), both dormant unless ``NVRAR_VLLM`` is set:

* ``vllm.general_plugins`` -> :func:`register` (vLLM loads it in every process, workers included,
  before the process groups exist; ``VLLM_PLUGINS``, when set, must name ``nvrar``). With
  ``NVRAR_VLLM=1`` it makes the platform vLLM detected hand out nvrar's device communicators:
  ``NvrarCpuCommunicator`` where vLLM would use its ``CpuCommunicator``, ``NvrarCudaCommunicator``
  where it would use its ``CudaCommunicator`` (nvrar/integrations/vllm_communicators.py).
* ``vllm.platform_plugins`` -> :func:`platform`: with ``NVRAR_VLLM=platform`` it supplies the
  platform itself, a subclass of vLLM's CPU or CUDA platform (whichever vLLM's own detection
  picks) whose ``get_device_communicator_cls`` names nvrar's communicator
  (nvrar/integrations/vllm_platforms.py). It then replaces vLLM's built-in choice, so it cannot be
  combined with another out-of-tree platform.

The communicators serve the tensor-parallel group (``unique_name`` "tp:...") with nvrar where
nvrar's policy serves the size, dtype and op (nvrar.selector: every size on CPUs; multi-node
messages up to settings.GPU_NATIVE_ABOVE on GPUs) and hand every other call, and every other
group, to vLLM's own communicator. Importing this module imports no vLLM module.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional

from ._common import switch

__all__ = ["register", "platform", "enabled", "stats", "COMMUNICATORS", "PLATFORMS"]

VARIABLE = "NVRAR_VLLM"
_MODES = ("1", "platform")
_PKG = "nvrar.integrations"
# vLLM's communicator (qualified name its platforms return) -> nvrar's subclass of it.
COMMUNICATORS: Dict[str, str] = {
    "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator":
        f"{_PKG}.vllm_communicators.NvrarCpuCommunicator",
    "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator":
        f"{_PKG}.vllm_communicators.NvrarCudaCommunicator",
}
# vLLM's built-in platform (qualified name its detection returns) -> nvrar's subclass of it.
PLATFORMS: Dict[str, str] = {
    "vllm.platforms.cpu.CpuPlatform": f"{_PKG}.vllm_platforms.NvrarCpuPlatform",
    "vllm.platforms.cuda.CudaPlatform": f"{_PKG}.vllm_platforms.NvrarCudaPlatform",
}
_PATCHED = "_nvrar_patched"


def enabled() -> str:
    """"" (dormant), "1" (the general plugin) or "platform" (the platform plugin too)."""
    return switch(VARIABLE, _MODES)


def communicator_for(name: str) -> str:
    """nvrar's communicator in place of vLLM's ``name`` (qualified), or ``name`` itself."""
    return COMMUNICATORS.get(name, name)


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent: the platform's method is wrapped once."""
    if not enabled():
        return
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if getattr(cls, _PATCHED, False):
        return
    original = cls.get_device_communicator_cls

    def get_device_communicator_cls(klass: Any) -> str:
        return communicator_for(original())

    cls.get_device_communicator_cls = classmethod(get_device_communicator_cls)
    setattr(cls, _PATCHED, True)


def platform() -> Optional[str]:
    """The ``vllm.platform_plugins`` entry point: nvrar's platform (qualified name) when
    ``NVRAR_VLLM=platform`` and vLLM's own detection finds a CPU or CUDA platform; else None."""
    if enabled() != "platform":
        return None
    from vllm import platforms as vp

    for detect in ("cuda_platform_plugin", "cpu_platform_plugin"):
        found = getattr(vp, detect)()
        if found in PLATFORMS:
            return PLATFORMS[found]
    return None


def stats() -> Dict[str, Dict[str, Any]]:
    """Per group this process serves through nvrar's communicators (by vLLM's ``unique_name``):
    whether nvrar serves it, the calls nvrar served and those left to vLLM. Empty when vLLM's
    groups were not made with nvrar's communicators."""
    comms = sys.modules.get(f"{_PKG}.vllm_communicators")
    return comms.stats() if comms is not None else {}
