"""Helpers of the integration tests on the real model."""
from __future__ import annotations

import torch

from tierkv import TierConfig, TieredCache

# Layer-wise prefill sums attention in query blocks, plain transformers in one pass: fp32
# rounding differs by a few ulps per layer, ~1e-5 relative on the logits after 30 layers.
LOGIT_ATOL = 1e-3


def saved_document(model, tok, path):
    """A short text prefilled through a ``full`` cache and saved under ``path``: (ids, doc)."""
    ids = tok("A short text. " * 40, return_tensors="pt")["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache, \
            torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        cache.save(path)
        return ids, cache.doc


def generate(model, ids, cache=None, new=8):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache)
    return out[0, ids.shape[1]:]
