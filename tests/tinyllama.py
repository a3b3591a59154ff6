"""Tiny random Llamas for tests that need a model but no model file: 2 KV heads of 8 (GQA, 4
query heads), a vocabulary of 64, fp32."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PER_TOKEN = 2 * 2 * 8 * 4  # keys and values, 2 kv heads of 8, fp32: bytes a token and layer


def tiny(layers: int = 4, seed: int = 0, **over) -> LlamaForCausalLM:
    """A random Llama of ``layers`` layers, its weights seeded; ``over`` overrides its config."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{"num_hidden_layers": layers, "hidden_size": 32,
                            "num_attention_heads": 4, "num_key_value_heads": 2,
                            "intermediate_size": 64, "vocab_size": 64, **over})
    config._name_or_path = "tiny"
    return LlamaForCausalLM(config).eval()


def ids(n: int, seed: int = 1) -> torch.Tensor:
    """``n`` seeded token ids, shape (1, n)."""
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed))
