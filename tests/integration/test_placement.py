"""Where a prompt's records lie when decode begins: the host keeps what the prompt attended."""
from __future__ import annotations

import pytest
import torch

import tierkv.hf.cache
from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.hf.cache import PINNED
from tierkv.hf.prefill import RANK_SPAN
from tierkv.shapes import KVShape

pytestmark = pytest.mark.integration


def _first_step_disk_bytes(model, ids, root):
    """Prefill ``ids`` with a host tier of a fifth of the KV, check the ranks the records got,
    then decode one token: the bytes that step read from disk."""
    kv = KVShape.from_config(model.config, dtype=model.dtype).kv_bytes(ids.shape[1])
    config = TierConfig(device_budget="8MB", host_budget=kv // 5, disk_dir=root)
    with TieredCache(model, config, "tierkv", select=SelectConfig(budget=0.1)) as cache, \
            torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        store = cache.store
        ranked = [(store._ranks.importance(key), store.where(key)) for index in cache.indexes
                  for key in index.keys if store._ranks.importance(key) < PINNED]
        assert ranked and all(0.0 <= rank <= RANK_SPAN for rank, _ in ranked)
        on_host = [rank for rank, where in ranked if where == "host"]
        on_disk = [rank for rank, where in ranked if where == "disk"]
        assert on_host and on_disk, "the host tier must hold part of the prompt"
        assert min(on_host) >= max(on_disk), "a record on disk ranks above one on the host"
        before = cache.stats()["disk_bytes_read"]
        model(logits[:, -1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
        return cache.stats()["disk_bytes_read"] - before, len({rank for rank, _ in ranked})


def test_the_first_step_reads_less_from_disk_than_with_every_record_ranked_alike(
        model_and_tok, passkey_cases, tmp_path, monkeypatch):
    model, _ = model_and_tok
    ids, _ = passkey_cases[2]
    ranked, levels = _first_step_disk_bytes(model, ids, tmp_path / "ranked")
    assert levels > 2
    monkeypatch.setattr(tierkv.hf.cache, "prompt_ranks",
                        lambda cache, g, start, count, hot, ranked: [hot] * count)
    alike, levels = _first_step_disk_bytes(model, ids, tmp_path / "alike")
    assert levels == 1
    assert ranked < alike, (ranked, alike)
