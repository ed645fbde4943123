"""Communication volume and call counts of tensor-, pipeline- and hybrid-parallel inference.

Notation (all per request): prompt (prefill) length Sp, generated (decode) length Sd, hidden size
h, layers L, vocabulary v, bytes per element b, tensor-parallel degree t, pipeline degree p, and
S = Sp + Sd - 1, the tokens that pass through the network: Sp in the prefill pass, then one token
in each of the Sd - 1 decode steps (the first generated token comes out of the prefill pass).
A volume is the bytes sent by one GPU, summed along the pipeline: the traffic of one chain of
ranks with the same TP index, one rank per stage.

Tensor parallelism (Megatron-style, vocabulary-parallel embedding and LM head)::

    V_tp = (2L+1) * S * h*b * 2(t-1)/t  +  Sd * (v/t) * b     (t > 1; V_tp = 0 for t = 1)

Each layer ends its attention and its MLP block with a row-parallel matmul whose partial sums are
all-reduced (2 per layer), and the vocabulary-parallel embedding adds one more: 2L+1 all-reduces of
h*b bytes per token. A bandwidth-optimal all-reduce of M bytes sends 2(t-1)/t * M per rank. The
last term gathers the Sd logit rows, each rank holding a v/t slice; with t = 1 one rank holds the
whole vocabulary and nothing crosses a link.

Pipeline parallelism::

    V_pp = (p-1) * 2 * S * h*b

p-1 stage boundaries; per token two h-vectors cross each boundary: the hidden state and the
residual stream (engines that fuse the residual add into RMSNorm, vLLM for one, ship both as
``IntermediateTensors``).

Hybrid TP x PP (derived here). Stage i holds L_i layers, sum L_i = L; every stage is a TP group of t.

1. All-reduces: stage i runs 2*L_i of them per token, stage 0 one more for the embedding; over the
   pipeline 2L+1, each on a TP group of t: (2L+1) * S * h*b * 2(t-1)/t.
2. Stage boundaries, with the scatter-gather optimisation (Megatron-LM): the activation is
   replicated over the t ranks of a stage, so rank j sends only its 1/t slice (2*h*b/t per token)
   to rank j of the next stage, which rebuilds the full vector with an all-gather in its TP group,
   sending (t-1)/t * 2*h*b. Per chain: (p-1) * S * 2*h*b * (1/t + (t-1)/t) = (p-1) * 2 * S * h*b.
   The (t-1)/t all-gather term applies only when t > 1. Without scatter-gather every rank sends the
   whole 2*h*b: the same bytes per chain, t times the bytes on the inter-stage links, no all-gather.
3. Logits: only the last stage has an LM head; with t > 1 its TP group gathers the Sd logit rows,
   Sd * (v/t) * b. With t = 1 the last stage holds the whole vocabulary and samples locally: 0.

So::

    V_hyb = (2L+1) * S * h*b * 2(t-1)/t  +  (p-1) * 2 * S * h*b  +  [t > 1] * Sd * (v/t) * b

which is V_tp when p = 1 and V_pp when t = 1.

Calls: with t > 1 a request costs 2L+1 all-reduce calls in prefill and (2L+1)(Sd-1) in decode.
The message of one call is batch x tokens x h x b bytes: batch*Sp*h*b in a batched prefill and
batch*h*b in a decode step, where continuous batching puts one token of each of the batch's
requests into every decode step (the calls are shared, the message grows with the batch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List

__all__ = [
    "Volume",
    "tokens_through",
    "allreduce_volume",
    "tp_volume",
    "pp_volume",
    "hybrid_volume",
    "allreduce_calls",
    "stage_layers",
    "message_bytes",
]


def _check(name: str, value: int, minimum: int) -> None:
    if int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def tokens_through(prompt: int, decode: int) -> int:
    """S = Sp + Sd - 1: tokens that pass through the model for one request."""
    _check("prompt", prompt, 1)
    _check("decode", decode, 1)
    return prompt + decode - 1


def allreduce_volume(message: float, ranks: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of ``message`` bytes: 2(n-1)/n * M."""
    _check("ranks", ranks, 1)
    return 2.0 * (ranks - 1) / ranks * message


@dataclass(frozen=True)
class Volume:
    """Bytes per request sent by one chain of ranks (one per stage), split by collective."""

    allreduce: float
    p2p: float
    allgather: float
    logits: float

    @property
    def total(self) -> float:
        return self.allreduce + self.p2p + self.allgather + self.logits

    def as_dict(self) -> Dict[str, float]:
        out = asdict(self)
        out["total"] = self.total
        return out


def hybrid_volume(layers: int, hidden: int, vocab: int, prompt: int, decode: int,
                  tp: int = 1, pp: int = 1, bytes_per_elem: int = 2) -> Volume:
    """Volume of TP x PP inference for one request (see the module docstring for the derivation)."""
    _check("layers", layers, 1)
    _check("tp", tp, 1)
    _check("pp", pp, 1)
    tokens = tokens_through(prompt, decode)
    act = tokens * hidden * bytes_per_elem  # bytes of one h-vector per token, over the request
    return Volume(
        allreduce=(2 * layers + 1) * allreduce_volume(act, tp),
        p2p=(pp - 1) * 2.0 * act / tp,
        allgather=(pp - 1) * 2.0 * act * (tp - 1) / tp,
        logits=decode * (vocab / tp) * bytes_per_elem if tp > 1 else 0.0,
    )


def tp_volume(layers: int, hidden: int, vocab: int, prompt: int, decode: int,
              tp: int, bytes_per_elem: int = 2) -> float:
    """V_tp = (2L+1)(Sp+Sd-1) h b 2(t-1)/t + Sd (v/t) b for t > 1; 0 for t = 1."""
    return hybrid_volume(layers, hidden, vocab, prompt, decode, tp, 1, bytes_per_elem).total


def pp_volume(hidden: int, prompt: int, decode: int, pp: int, bytes_per_elem: int = 2) -> float:
    """V_pp = (p-1) 2 (Sp+Sd-1) h b (no logits term: the last stage samples locally)."""
    _check("pp", pp, 1)
    return (pp - 1) * 2.0 * tokens_through(prompt, decode) * hidden * bytes_per_elem


def allreduce_calls(layers: int, decode: int, tp: int = 2) -> Dict[str, int]:
    """All-reduce calls per request: prefill 2L+1, decode (2L+1)(Sd-1); none without TP (t = 1)."""
    _check("layers", layers, 1)
    _check("decode", decode, 1)
    per_pass = 2 * layers + 1 if tp > 1 else 0
    return {"prefill": per_pass, "decode": per_pass * (decode - 1)}


def stage_layers(layers: int, pp: int) -> List[int]:
    """Layers per pipeline stage, as even as possible (the first stages take the remainder)."""
    _check("pp", pp, 1)
    if pp > layers:
        raise ValueError(f"pp={pp} exceeds the number of layers ({layers})")
    base, extra = divmod(layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def message_bytes(hidden: int, bytes_per_elem: int, batch: int, tokens: int) -> int:
    """Bytes of one all-reduce call: batch x tokens x h x b."""
    _check("batch", batch, 1)
    _check("tokens", tokens, 1)
    return batch * tokens * hidden * bytes_per_elem
