"""nvrar's device communicators for vLLM: subclasses of vLLM's own, so that everything vLLM asks
of a communicator (all-gather, reduce-scatter, send/recv, all-to-all, CUDA-graph capture, destroy)
stays vLLM's, and only the all-reduce of the tensor-parallel group goes to nvrar where nvrar's
policy serves it. Imported by vLLM (through the names nvrar.integrations.vllm hands it), never by
nvrar itself: importing this module imports vLLM.

vLLM's contract for ``all_reduce(input_)``: the result is returned, and on the custom-op path
(``torch.ops.vllm.all_reduce``, whose fake implementation is ``empty_like``) the input is not
changed. nvrar's path writes the sum into a new tensor and leaves the input as it was.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Optional

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from ._common import Serving, spans_hosts

__all__ = ["NvrarCpuCommunicator", "NvrarCudaCommunicator", "stats"]  # noqa: F822 (the CUDA one: module __getattr__)

# Groups vLLM gives nvrar: its tensor-parallel groups (unique_name "tp:<n>").
SERVED_GROUPS = ("tp",)

_lock = threading.Lock()
_live: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def _served(unique_name: str, world_size: int) -> bool:
    return world_size > 1 and unique_name.split(":", 1)[0] in SERVED_GROUPS


def stats() -> Dict[str, Dict[str, Any]]:
    """Per live nvrar communicator of this process (by vLLM's unique_name): Serving.stats()."""
    with _lock:
        comms = dict(_live)
    return {name: c.nvrar_stats() for name, c in comms.items()}


class _NvrarMixin:
    """The part both communicators share: the nvrar Serving of a TP group, the out-of-place
    all-reduce through it, the stats and destroy()."""

    nvrar: Optional[Serving] = None
    unique_name: str
    world_size: int
    cpu_group: Any

    def _nvrar_start(self, device: str) -> None:
        if _served(self.unique_name, self.world_size):
            self.nvrar = Serving(self.cpu_group, device, f"vLLM group {self.unique_name}")
            with _lock:
                _live[self.unique_name] = self

    def _nvrar_all_reduce(self, input_: torch.Tensor, stream: Any = None) -> Optional[torch.Tensor]:
        serving = self.nvrar
        if serving is None:
            return None
        return serving.all_reduce_out_of_place(input_, "sum", stream)

    def nvrar_stats(self) -> Dict[str, Any]:
        """Whether nvrar serves this group, and the calls it served ("nvrar") and left to vLLM ("native")."""
        if self.nvrar is None:
            return {"group": self.unique_name, "served_by_nvrar": False, "why_not": "not a tensor-parallel group",
                    "nvrar": 0, "native": 0}
        return self.nvrar.stats()

    def _nvrar_destroy(self) -> None:
        serving, self.nvrar = self.nvrar, None
        if serving is not None:
            with _lock:
                if _live.get(self.unique_name) is self:
                    del _live[self.unique_name]
            serving.close()


class NvrarCpuCommunicator(_NvrarMixin, CpuCommunicator):
    """vLLM's CpuCommunicator with its tensor-parallel all-reduce served by nvrar's CPU executor
    (shared memory inside a host, UCX between hosts).

    Across hosts, vLLM's own shared-memory kernel (vLLM CPU builds with it) would join ranks of
    different hosts in one shared-memory group and wait for ever; there every collective of the
    group that nvrar does not serve goes through torch.distributed (gloo) instead."""

    def __init__(self, cpu_group: Any, *args: Any, **kwargs: Any) -> None:
        world = torch.distributed.get_world_size(cpu_group)
        # Collective over the group, before the parent decides on its shared-memory kernel.
        self.nvrar_across_hosts = world > 1 and spans_hosts(cpu_group)
        super().__init__(cpu_group, *args, **kwargs)
        if self.nvrar_across_hosts:
            self.dist_module = torch.distributed
            self.supports_tensor_dict = False
        self._nvrar_start("cpu")

    def _all_group_ranks_share_shm_group_name(self) -> bool:
        if self.nvrar_across_hosts:
            return False
        return bool(super()._all_group_ranks_share_shm_group_name())

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self.nvrar is not None and torch.compiler.is_compiling():
            # vLLM's opaque custom op: its implementation comes back here at run time.
            return torch.ops.vllm.all_reduce(input_, group_name=self.unique_name)
        out = self._nvrar_all_reduce(input_)
        if out is not None:
            return out
        return super().all_reduce(input_)

    def destroy(self) -> None:
        self._nvrar_destroy()
        super().destroy()


def _cuda_communicator_class() -> type:
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    class NvrarCudaCommunicator(_NvrarMixin, CudaCommunicator):
        """vLLM's CudaCommunicator (so CUDA-graph capture, custom all-reduce and PyNCCL stay
        vLLM's) with the tensor-parallel all-reduce served by nvrar's GPU executor where nvrar's
        policy takes the size: multi-node messages up to settings.GPU_NATIVE_ABOVE; every other
        call goes down vLLM's own chain. Not yet run on a GPU (docs/engines.md)."""

        def __init__(self, cpu_group: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(cpu_group, *args, **kwargs)
            self._nvrar_start("cuda")

        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            out = self._nvrar_all_reduce(input_, torch.cuda.current_stream(input_.device))
            if out is not None:
                return out
            return super().all_reduce(input_)

        def destroy(self) -> None:
            self._nvrar_destroy()
            super().destroy()

    NvrarCudaCommunicator.__module__ = __name__
    NvrarCudaCommunicator.__qualname__ = "NvrarCudaCommunicator"
    return NvrarCudaCommunicator


_cuda_class: Optional[type] = None


def __getattr__(name: str) -> Any:
    # The CUDA communicator is made on first use, so that the CPU one never imports vLLM's CUDA modules.
    global _cuda_class
    if name == "NvrarCudaCommunicator":
        if _cuda_class is None:
            _cuda_class = _cuda_communicator_class()
        return _cuda_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
