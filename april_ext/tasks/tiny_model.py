"""What the built-in synthetic tasks share: their special token ids and the tiny Llama each trains on a CPU."""

from __future__ import annotations

from typing import Any

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3


def tiny_model_config(vocab_size: int, max_positions: int, **overrides: Any) -> Any:
    """A tiny Llama ModelConfig (hidden 64, 2 layers, 4 heads) over ``vocab_size`` tokens and sequences of up to
    ``max_positions``; ``overrides`` replace any field."""
    from april_ext.model import ModelConfig

    fields: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": max_positions, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    }
    fields.update(overrides)
    return ModelConfig(**fields)
