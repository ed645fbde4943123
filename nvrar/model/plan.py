"""The inference plan: volumes, call counts, message sizes and per-token communication time.

Placement: TP x PP = t*p GPUs on N nodes of G GPUs, rank-major: stage i holds ranks
[i*t, (i+1)*t). A TP group of t <= G ranks stays inside one node (G must be a multiple of t);
a larger one spans t/G whole nodes. Only the all-reduces change with the backend: stage hand-offs
(NCCL send/recv), the scatter-gather all-gather and the logits gather are costed with NCCL's model
for both backends.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .cards import ModelCard
from .latency import Terms, evaluate, nccl_allgather_terms, nccl_sendrecv_terms, predict
from .profiles import Profile
from .volume import allreduce_calls, hybrid_volume, message_bytes, stage_layers, tokens_through

__all__ = ["tp_layout", "make_plan"]


def tp_layout(tp: int, pp: int, nodes: Optional[int], gpus: int) -> Tuple[int, int, int, int]:
    """(nodes, tp_nodes, tp_gpus_per_node, inter-node stage boundaries) for t x p on N x G."""
    world = tp * pp
    if nodes is None:
        nodes = -(-world // gpus)
    if nodes * gpus != world and not (nodes == 1 and world <= gpus):
        raise ValueError(f"tp*pp = {world} GPUs do not fill {nodes} nodes x {gpus} GPUs")
    if tp <= gpus:
        if gpus % tp:
            raise ValueError(f"a TP group of {tp} does not tile nodes of {gpus} GPUs")
        tp_nodes, tp_gpus = 1, tp
    else:
        if tp % gpus:
            raise ValueError(f"a TP group of {tp} does not span whole nodes of {gpus} GPUs")
        tp_nodes, tp_gpus = tp // gpus, gpus
    inter = sum(1 for i in range(1, pp) if (i * tp) // gpus != (i * tp - 1) // gpus)
    return nodes, tp_nodes, tp_gpus, inter


def _pass_costs(card: ModelCard, tp: int, pp: int, layout: Tuple[int, int, int, int],
                batch: int, tokens: int, logits_rows: int, b: int,
                profile: Profile) -> Dict[str, Any]:
    """Communication of one forward pass of ``batch`` x ``tokens`` tokens, in us, per backend."""
    _, tp_nodes, tp_gpus, inter = layout
    msg = message_bytes(card.hidden, b, batch, tokens)
    other: List[Terms] = []
    if pp > 1:
        handoff = 2.0 * msg / tp  # hidden state + residual, this rank's 1/t slice
        other += [nccl_sendrecv_terms(handoff, True)] * inter
        other += [nccl_sendrecv_terms(handoff, False)] * (pp - 1 - inter)
        if tp > 1:
            other += [nccl_allgather_terms(2.0 * msg, tp_nodes, tp_gpus)] * (pp - 1)
    if tp > 1:
        other.append(nccl_allgather_terms(float(logits_rows * card.vocab * b), tp_nodes, tp_gpus))
    other_us = sum(evaluate(t, profile) for t in other)
    calls = 2 * card.layers + 1 if tp > 1 else 0
    if calls:
        pred = predict(msg, tp_nodes, tp_gpus, profile)
        ar = {"nccl": pred["predicted_us"]["nccl"], "nvrar": pred["predicted_us"]["nvrar"]}
        choice = {"nccl": pred["nccl_choice"], "nvrar": pred["nvrar_choice"]}
    else:
        ar, choice = {"nccl": 0.0, "nvrar": 0.0}, {}
    return {
        "message_bytes": msg,
        "allreduce_us_per_call": ar,
        "allreduce_choice": choice,
        "allreduce_us": {k: calls * v for k, v in ar.items()},
        "other_us": other_us,
        "total_us": {k: calls * v + other_us for k, v in ar.items()},
    }


def make_plan(card: ModelCard, tp: int, pp: int, prompt: int, decode: int, batch: int = 1,
              bytes_per_elem: int = 2, profile: Optional[Profile] = None,
              nodes: Optional[int] = None, gpus_per_node: Optional[int] = None) -> Dict[str, Any]:
    """Everything ``nvrar plan`` reports, as a JSON-ready dict."""
    b = bytes_per_elem
    vol = hybrid_volume(card.layers, card.hidden, card.vocab, prompt, decode, tp, pp, b)
    layers = stage_layers(card.layers, pp)
    per_stage = [2 * n + (1 if i == 0 else 0) if tp > 1 else 0 for i, n in enumerate(layers)]
    plan: Dict[str, Any] = {
        "model": card.name,
        "model_source": card.source,
        "tp": tp, "pp": pp, "prompt": prompt, "decode": decode, "batch": batch,
        "bytes_per_elem": b,
        "tokens_through": tokens_through(prompt, decode),
        "volume_bytes": vol.total,
        "volume_breakdown_bytes": vol.as_dict(),
        "volume_bytes_per_batch": vol.total * batch,
        "allreduce_calls": allreduce_calls(card.layers, decode, tp),
        "allreduce_calls_per_stage": per_stage,
        "stage_layers": layers,
        "p2p_calls": {"prefill": pp - 1, "decode": (pp - 1) * (decode - 1)},
        "message_bytes": {
            "prefill": message_bytes(card.hidden, b, batch, prompt),
            "decode": message_bytes(card.hidden, b, batch, 1),
        },
        "warnings": [],
    }
    if card.heads % tp:
        plan["warnings"].append(f"tp={tp} does not divide the {card.heads} attention heads")
    if profile is not None:
        gpus = gpus_per_node or profile.gpus_per_node
        layout = tp_layout(tp, pp, nodes, gpus)
        decode_step = _pass_costs(card, tp, pp, layout, batch, 1, batch, b, profile)
        prefill = _pass_costs(card, tp, pp, layout, batch, prompt, batch, b, profile)
        plan.update({
            "profile": profile.name,
            "layout": {"nodes": layout[0], "gpus_per_node": gpus, "tp_nodes": layout[1],
                       "tp_gpus_per_node": layout[2], "inter_node_stage_boundaries": layout[3]},
            "comm_us_per_token": decode_step["total_us"],
            "decode_step": decode_step,
            "prefill": prefill,
            "comm_us_per_batch": {
                k: prefill["total_us"][k] + (decode - 1) * decode_step["total_us"][k]
                for k in ("nccl", "nvrar")
            },
        })
    return plan
