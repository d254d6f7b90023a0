"""A tiny random Llama for the transformers tests (fast on a CPU)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(num_hidden_layers: int = 2, **config: Any) -> Any:
    """A random ``LlamaForCausalLM`` (vocab 256, hidden 64, 4 heads over 2 KV heads), seeded, in eval mode."""
    import transformers

    cfg = transformers.LlamaConfig(**({
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024} | config))
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()
