"""SGLang plugin: SGLang's tensor-parallel all-reduce served by nvrar, through SGLang's own
``HookRegistry`` (no patch of SGLang's files).

Entry point ``sglang.srt.plugins`` -> :func:`register`, named ``nvrar`` (``SGLANG_PLUGINS``, when
set, must name it); dormant unless ``NVRAR_SGLANG=1``. It registers hooks on SGLang's
``GroupCoordinator`` (sglang.srt.distributed.parallel_state):

* ``__init__`` (after): a tensor-parallel group (unique_name "tp:...") of more than one rank gets
  an nvrar Communicator over its CPU (gloo) group, on the group's device kind ("cuda" or "cpu").
* ``_resolve_outplace_all_reduce_method`` (around): adds the method "nvrar" to SGLang's
  out-of-place chain, after the chain's own picks (custom AR, PCIe IPC, quick AR, pymscclpp,
  torch symm mem) and before PyNCCL, for the sizes nvrar's policy serves; under the same phase
  guards as pymscclpp (never during a piecewise CUDA graph's compile, capture or replay, nor in
  torch.compile warm-up), in eager mode and in CUDA-graph capture.
* ``_all_reduce_out_place`` (around): runs the "nvrar" method (also when SGLang passes "auto" and
  the chain resolves to it): the sum in a new tensor, the input unchanged.
* ``all_reduce`` (around): CPU tensors, which SGLang reduces in place before its chain (its
  shared-memory kernel or torch.distributed), are reduced in place by nvrar where it serves them.
* ``destroy`` (before): the nvrar Communicator is closed.

Importing this module imports no SGLang module; :func:`register` imports only the hook registry.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ._common import Serving, switch

__all__ = ["register", "enabled", "stats", "METHOD", "TARGET"]

VARIABLE = "NVRAR_SGLANG"
METHOD = "nvrar"  # the out-of-place method's name in SGLang's chain
TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator"
SERVED_GROUPS = ("tp",)
_registered = False
_live: Dict[str, Any] = {}


def enabled() -> bool:
    return switch(VARIABLE, ("1",)) == "1"


def _serving(group: Any) -> Optional[Serving]:
    return getattr(group, "nvrar", None)


def _after_init(result: Any, group: Any, *args: Any, **kwargs: Any) -> None:
    group.nvrar = None
    if group.world_size <= 1 or group.unique_name.split(":", 1)[0] not in SERVED_GROUPS:
        return None
    device = getattr(group, "device", None)
    kind = "cuda" if getattr(device, "type", str(device)) == "cuda" else "cpu"
    group.nvrar = Serving(group.cpu_group, kind, f"SGLang group {group.unique_name}")
    _live[group.unique_name] = group
    return None


def _phase_allows() -> bool:
    """The phase guards of SGLang's pymscclpp: never in a piecewise CUDA graph's compile, capture
    or replay, nor in torch.compile warm-up."""
    from sglang.srt.compilation.compile_phase import get_pcg_capture_stream, is_in_torch_compile_warmup
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
        is_in_tc_piecewise_cuda_graph,
    )

    return not (is_in_tc_piecewise_cuda_graph() or is_in_torch_compile_warmup() or get_pcg_capture_stream() is not None)


def _wants(group: Any, input_: Any) -> bool:
    from ..selector import NATIVE

    serving = _serving(group)
    return (serving is not None and serving.device == input_.device.type
            and serving.decide(input_) != NATIVE and (input_.is_cpu or _phase_allows()))


def _around_resolve(original: Callable, group: Any, input_: Any, *args: Any, **kwargs: Any) -> Optional[str]:
    method = original(group, input_, *args, **kwargs)
    if method is None and _wants(group, input_):
        return METHOD
    return method


def _around_out_place(original: Callable, group: Any, input_: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    if method == "auto" and _wants(group, input_) and group._resolve_outplace_all_reduce_method(input_) == METHOD:
        method = METHOD
    if method == METHOD:
        serving = _serving(group)
        assert serving is not None
        stream = None
        if serving.device == "cuda":
            import torch

            stream = torch.cuda.current_stream(input_.device)
        out = serving.all_reduce_out_of_place(input_, "sum", stream)
        if out is None:
            raise RuntimeError(f"nvrar: {group.unique_name}: the method {METHOD!r} was chosen for a call nvrar's "
                               f"policy does not serve ({input_.dtype}, {input_.numel()} elements)")
        return out
    return original(group, input_, method, *args, **kwargs)


def _around_all_reduce(original: Callable, group: Any, input_: Any, *args: Any, **kwargs: Any) -> Any:
    serving = _serving(group)
    if serving is not None and input_.is_cpu and serving.device == "cpu":
        if input_.is_contiguous() and _wants(group, input_):
            serving.counts["nvrar"] += 1
            return serving.comm.all_reduce(input_)  # in place, as SGLang's own CPU path
        serving.counts["native"] += 1
    return original(group, input_, *args, **kwargs)


def _before_destroy(group: Any, *args: Any, **kwargs: Any) -> None:
    serving = _serving(group)
    if serving is not None:
        name: str = group.unique_name
        group.nvrar = None
        if _live.get(name) is group:
            del _live[name]
        serving.close()
    return None


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: registers the hooks (once per process) when
    ``NVRAR_SGLANG=1``. SGLang's load_plugins() applies them."""
    global _registered
    if not enabled() or _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{TARGET}.__init__", _after_init, HookType.AFTER)
    HookRegistry.register(f"{TARGET}._resolve_outplace_all_reduce_method", _around_resolve, HookType.AROUND)
    HookRegistry.register(f"{TARGET}._all_reduce_out_place", _around_out_place, HookType.AROUND)
    HookRegistry.register(f"{TARGET}.all_reduce", _around_all_reduce, HookType.AROUND)
    HookRegistry.register(f"{TARGET}.destroy", _before_destroy, HookType.BEFORE)
    _registered = True


def stats() -> Dict[str, Dict[str, Any]]:
    """Per SGLang group this process serves through nvrar (by unique_name): Serving.stats()."""
    out = {}
    for name, group in list(_live.items()):
        serving = _serving(group)
        if serving is not None:
            out[name] = serving.stats()
    return out
