"""``razor``: RazorAttention. Retrieval heads keep every token; the other heads keep the sinks,
the recent window and one compensation token: the mean K and V of what they dropped, whose score
is raised by log(number dropped) so it weighs in the softmax as the dropped tokens together would
if they were alike. Lossy. Retrieval heads come from the model profile (``tierkv calibrate``).
"""
import math

import torch

from ..attention import scored_decode_attention
from .base import Policy, on_device, register, retrieval_heads_of


@register
class Razor(Policy):
    """Whole GQA groups of retrieval heads attend fully; the rest are compressed."""

    name = "razor"
    lossy = True

    def __init__(self, layers, select, chunks, profile):
        super().__init__(layers, select, chunks, profile)
        heads = profile.get("retrieval_heads")
        if heads is None:
            raise ValueError("policy 'razor' needs a profile with retrieval_heads: run `tierkv calibrate`")
        self.retrieval = retrieval_heads_of(heads, layers, "profile retrieval_heads")

    def attend(self, cache, layer, q, k, v, positions, scaling):
        kv_heads = k.shape[0]
        n = cache.layer_length(layer)
        full = torch.zeros(kv_heads, dtype=torch.bool)
        full[self.retrieval.get(layer, [])] = True
        kept = (positions < self.select.sinks) | (positions >= n - self.select.window)
        dropped = ~kept
        count = int(dropped.sum())
        if count == 0 or bool(full.all()):
            return super().attend(cache, layer, q, k, v, positions, scaling)
        dropped = on_device(dropped.float(), k)
        comp_k = (dropped @ k.float()) / count  # (kv, d): mean over dropped tokens per head
        comp_v = (dropped @ v.float()) / count
        # the compensation token first: the last keys are the query tokens' own
        k2 = torch.cat([comp_k.to(k.dtype).unsqueeze(1), k], dim=1)
        v2 = torch.cat([comp_v.to(v.dtype).unsqueeze(1), v], dim=1)
        allowed = torch.cat([(~full)[:, None], kept.expand(kv_heads, -1) | full[:, None]], dim=1)
        bias = torch.zeros(kv_heads, k2.shape[1])
        bias[:, 0] = math.log(count)
        out, _ = scored_decode_attention(q, k2, v2, scaling, on_device(allowed[:, None, None], q),
                                         on_device(bias[:, None, None], q))
        return out
