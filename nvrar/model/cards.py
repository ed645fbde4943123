"""Model cards: the few architecture numbers the planner needs, with their sources.

Each card is copied by hand from the model's public ``config.json`` on Hugging Face
(fields ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``num_attention_heads``,
``num_key_value_heads``); the URL is stored with the card so that every number can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

__all__ = ["ModelCard", "CARDS", "get_card"]


@dataclass(frozen=True)
class ModelCard:
    """Architecture of a decoder-only transformer, as far as communication is concerned.

    Attributes:
        name: short name used on the command line.
        layers: transformer blocks L (``num_hidden_layers``).
        hidden: hidden size h (``hidden_size``), elements per token in each all-reduce.
        vocab: vocabulary size v (``vocab_size``), elements per token in the logits.
        heads: attention heads (``num_attention_heads``); the TP degree should divide it.
        kv_heads: key/value heads (``num_key_value_heads``); replicated when TP > kv_heads.
        source: URL of the config.json the numbers come from.
    """

    name: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    source: str


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


CARDS: Dict[str, ModelCard] = {
    card.name: card
    for card in (
        ModelCard("llama-3.2-3b", 28, 3072, 128256, 24, 8, _hf("meta-llama/Llama-3.2-3B")),
        ModelCard("llama-3.1-8b", 32, 4096, 128256, 32, 8, _hf("meta-llama/Llama-3.1-8B")),
        ModelCard("llama-2-13b", 40, 5120, 32000, 40, 40, _hf("meta-llama/Llama-2-13b-hf")),
        ModelCard("llama-3.1-70b", 80, 8192, 128256, 64, 8, _hf("meta-llama/Llama-3.1-70B")),
        ModelCard("llama-3.1-405b", 126, 16384, 128256, 128, 8, _hf("meta-llama/Llama-3.1-405B")),
    )
}


def get_card(name: str) -> ModelCard:
    """Return the card called ``name`` (case-insensitive); raise KeyError naming the known cards."""
    key = name.lower()
    if key not in CARDS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(CARDS))}")
    return CARDS[key]
