"""What the engine plugins share: the switch variables, and the serving of one engine group's
all-reduces by an nvrar Communicator under nvrar's one policy (nvrar.selector.select, the same
decision as nvrar.torch: nvrar where it serves the size, dtype and op, the engine's own path
otherwise), with counts the tests and users can read."""

from __future__ import annotations

import socket
from typing import Any, Dict, List, Optional

from .. import env

OFF = ("", "0", "false", "no", "off")


def switch(name: str, allowed: tuple) -> str:
    """The value of the switch variable ``name``, lower-cased: "" when it is off, else one of
    ``allowed`` (ValueError naming the variable otherwise: a typo must not leave nvrar silently
    unused)."""
    value = (env.get_str(name) or "").strip().lower()
    if value in OFF:
        return ""
    if value in ("true", "yes", "on"):
        value = "1"
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: use one of 0, {', '.join(allowed)}")
    return value


def spans_hosts(cpu_group: Any) -> bool:
    """Whether the ranks of ``cpu_group`` (a torch.distributed gloo group) run on more than one host
    (host names, as nvrar's own set-up tells hosts apart). Collective over the group."""
    import torch.distributed as dist

    names: List[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(names, socket.gethostname(), group=cpu_group)
    return len(set(names)) > 1


def _engine_group_bootstrap_class() -> type:
    from ..bootstrap import TorchBootstrap

    class EngineGroupBootstrap(TorchBootstrap):
        """nvrar's set-up over an engine group's gloo group, with the ranks per node taken from the
        ranks' host names (or NVRAR_RANKS_PER_NODE), never from the launcher's variables: inside
        an engine these describe the engine's own start-up, not its groups. vLLM's CPU platform,
        for one, sets LOCAL_WORLD_SIZE to the tensor-parallel size, which across hosts would make
        nvrar take every rank of the group for one node and refuse the group."""

        @property
        def launcher_local_size(self) -> Optional[int]:
            return None

    return EngineGroupBootstrap


def _EngineGroupBootstrap(cpu_group: Any, timeout: float) -> Any:
    return _engine_group_bootstrap_class()(cpu_group, timeout)


class Serving:
    """nvrar serving the all-reduces of one engine group: a Communicator over the group's CPU
    (gloo) group, and the policy. Collective to create (every rank of the group at once); when
    nvrar cannot serve the group (set-up refused alike on every rank), every call is the engine's.
    """

    def __init__(self, cpu_group: Any, device: str, label: str) -> None:
        import torch.distributed as dist

        from .. import _torch_state

        self.label = label
        self.device = device
        self.state = _torch_state.GroupState(device, dist.get_world_size(cpu_group),
                                             lambda: _EngineGroupBootstrap(cpu_group, _torch_state.default_timeout()),
                                             label)
        self.counts = self.state.counts  # {"nvrar": calls nvrar served, "native": calls left to the engine}
        self._dtype_names = _torch_state.DTYPE_NAMES

    @property
    def comm(self) -> Any:
        return self.state.comm

    def decide(self, tensor: Any, op: str = "sum") -> str:
        """An nvrar algorithm, or "native" (nvrar.selector.NATIVE): the engine's own path."""
        return self.state.decide(self._dtype_names.get(tensor.dtype, str(tensor.dtype)), op,
                                 tensor.numel() * tensor.element_size())

    def all_reduce_out_of_place(self, tensor: Any, op: str = "sum", stream: Any = None) -> Optional[Any]:
        """The sum over the group in a new tensor (``tensor`` is left as it was), or None when the
        policy leaves this call to the engine (counted as "native")."""
        from ..selector import NATIVE

        choice = self.decide(tensor, op)
        if choice == NATIVE:
            self.counts["native"] += 1
            return None
        import torch

        src = tensor if tensor.is_contiguous() else tensor.contiguous()
        out = torch.empty_like(src)
        algorithm = None if choice == "auto" else choice
        if self.device == "cuda":
            self.comm.all_reduce(src, op, out=out, algorithm=algorithm, stream=stream)
        else:
            self.comm.all_reduce(src, op, out=out, algorithm=algorithm)
        self.counts["nvrar"] += 1
        return out

    def stats(self) -> Dict[str, Any]:
        comm = self.comm
        return {"group": self.label, "device": self.device, "served_by_nvrar": comm is not None,
                "why_not": self.state.native_only, "nvrar": self.counts["nvrar"], "native": self.counts["native"],
                "world_size": self.state.world, "ranks_per_node": comm.ranks_per_node if comm is not None else None,
                "nodes": comm.num_nodes if comm is not None else None}

    def close(self) -> None:
        self.state.close()
