"""The shape of a model's KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def text_config(config):
    """The language model's part of a (possibly multimodal) transformers config."""
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class KVShape:
    """Layers, KV heads, head size and dtype of a KV cache.

    ``q_heads`` is the number of query heads (a multiple of ``kv_heads`` under GQA).
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    q_heads: int | None = None

    def __post_init__(self):
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
                raise ValueError(f"{name}={value!r}: must be an integer in [1, 65536]")
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype={self.dtype!r}: must be float16, bfloat16 or float32")
        q = self.kv_heads if self.q_heads is None else self.q_heads
        if isinstance(q, bool) or not isinstance(q, int) or q < self.kv_heads or q % self.kv_heads:
            raise ValueError(f"q_heads={self.q_heads!r}: must be a multiple of kv_heads={self.kv_heads}")
        object.__setattr__(self, "q_heads", q)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.q_heads // self.kv_heads

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def token_bytes(self, layers: int | None = None) -> int:
        """Bytes of K and V for one token over ``layers`` layers (default: all)."""
        n_layers = self.layers if layers is None else layers
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 0:
            raise ValueError(f"layers={layers!r}: expected a layer count >= 0")
        return 2 * n_layers * self.kv_heads * self.head_dim * self.itemsize

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of the whole KV cache at ``tokens`` tokens."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens={tokens!r}: expected a token count >= 0")
        return tokens * self.token_bytes()

    @classmethod
    def from_config(cls, config, dtype: torch.dtype | None = None) -> "KVShape":
        """From a transformers ``PretrainedConfig`` of a decoder-only model with (GQA) attention."""
        text = text_config(config)
        try:
            layers = text.num_hidden_layers
            q_heads = text.num_attention_heads
            kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // q_heads
        except AttributeError as exc:
            raise ValueError(f"model config {type(config).__name__} has no {exc.name}: "
                             "not a decoder-only attention model tierkv supports") from exc
        except (TypeError, ZeroDivisionError):
            raise ValueError(f"model config {type(config).__name__}: num_attention_heads="
                             f"{q_heads!r} and hidden_size={getattr(text, 'hidden_size', None)!r} "
                             "give no head_dim") from None
        if dtype is None:
            dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or torch.float32
            if isinstance(dtype, str):
                dtype = DTYPES.get(dtype, torch.float32)
        return cls(layers, kv_heads, head_dim, dtype, q_heads)
