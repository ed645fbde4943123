"""Exceptions raised by nvrar.

Every failure of a collective is an :class:`NvrarError`. A failure caused by a deadline (a peer
that died, hangs or never arrived, on this rank or reported by the rank that aborted us) is an
:class:`NvrarTimeoutError`. Protocol failures carry structured fields naming where they happened.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["NvrarError", "NvrarTimeoutError"]


class NvrarError(RuntimeError):
    """A collective failed, or nvrar was used in a way it cannot serve.

    Attributes (``None`` where they do not apply):
        rank: the rank that raised.
        peer: the rank it was waiting for.
        phase: protocol phase ("reduce-scatter", "inter-node", "all-gather", "one-shot-reduce", ...).
        step: step index within the phase.
        epoch: the protocol round expected.
        observed: the epoch seen in the peer's flag.
        kind: "timeout", "mismatch", "peer-abort" or "violation".
    """

    def __init__(
        self,
        message: str,
        *,
        rank: Optional[int] = None,
        peer: Optional[int] = None,
        phase: Optional[str] = None,
        step: Optional[int] = None,
        epoch: Optional[int] = None,
        observed: Optional[int] = None,
        kind: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.phase = phase
        self.step = step
        self.epoch = epoch
        self.observed = observed
        self.kind = kind


class NvrarTimeoutError(NvrarError):
    """A wait passed its deadline (``timeout=`` / ``NVRAR_TIMEOUT_S``), or a peer process exited."""
