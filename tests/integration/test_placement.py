"""Where a prompt's records lie when decode begins: the host keeps what the prompt attended,
and what the preselecting layers would fetch first."""
from __future__ import annotations

import pytest
import torch

import tierkv.hf.seal
from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.hf.cache import PINNED
from tierkv.hf.prefill import RANK_SPAN
from tierkv.policies.tierkv import TierKV
from tierkv.shapes import KVShape
from tierkv.textgen import passkey_prompt
from tierkv.hf.model import cache_kwargs

pytestmark = pytest.mark.integration


def _first_step_disk_bytes(model, ids, root):
    """Prefill ``ids`` with a host tier of a fifth of the KV, check the ranks the records got,
    then decode one token: the bytes that step read from disk."""
    kv = KVShape.from_config(model.config, dtype=model.dtype).kv_bytes(ids.shape[1])
    config = TierConfig(device_budget="8MB", host_budget=kv // 5, disk_dir=root)
    with TieredCache(model, config, "tierkv", select=SelectConfig(budget=0.1)) as cache, \
            torch.no_grad():
        logits = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits
        store = cache.store
        ranked = [(store._ranks.importance(key), store.where(key)) for index in cache.indexes
                  for key in index.keys if store._ranks.importance(key) < PINNED]
        assert ranked and all(0.0 <= rank <= RANK_SPAN for rank, _ in ranked)
        on_host = [rank for rank, where in ranked if where == "host"]
        on_disk = [rank for rank, where in ranked if where == "disk"]
        assert on_host and on_disk, "the host tier must hold part of the prompt"
        assert min(on_host) >= max(on_disk), "a record on disk ranks above one on the host"
        before = cache.stats()["disk_bytes_read"]
        model(logits[:, -1].argmax(-1, keepdim=True), **cache_kwargs(model, cache), use_cache=True)
        return cache.stats()["disk_bytes_read"] - before, len({rank for rank, _ in ranked})


def test_the_first_step_reads_less_from_disk_than_with_every_record_ranked_alike(
        model_and_tok, passkey_cases, tmp_path, monkeypatch):
    model, _ = model_and_tok
    ids, _ = passkey_cases[2]
    ranked, levels = _first_step_disk_bytes(model, ids, tmp_path / "ranked")
    assert levels > 2
    monkeypatch.setattr(tierkv.hf.seal, "prompt_ranks",
                        lambda cache, g, start, count, hot, ranked: [hot] * count)
    alike, levels = _first_step_disk_bytes(model, ids, tmp_path / "alike")
    assert levels == 1
    assert ranked < alike, (ranked, alike)


def test_the_records_a_preselecting_layer_would_fetch_first_are_kept_on_the_host(
        model_and_tok, tmp_path, monkeypatch):
    """At 3K tokens with an 8 MB device tier the filter layers (and those before the first)
    preselect their candidates; the prefill ranks the records of the candidates that the
    prompt's last query picks first, so the host keeps every one of them, and the first step
    reads less from disk than when only the prompt's attention ranks them."""
    model, tok = model_and_tok
    prompt, _ = passkey_prompt(tok, 3000, seed=2)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    kv = KVShape.from_config(model.config, dtype=model.dtype).kv_bytes(ids.shape[1])
    real = TierKV.prompt_candidates

    def first_step(root, guess: bool):
        seen = {}

        def spy(policy, cache, layer, query):
            got = real(policy, cache, layer, query)
            if got is not None:
                seen[layer] = got
            return got if guess else None
        monkeypatch.setattr(TierKV, "prompt_candidates", spy)
        config = TierConfig(device_budget="8MB", host_budget=kv // 5, disk_dir=root)
        with TieredCache(model, config, "tierkv", select=SelectConfig(budget=0.1)) as cache, \
                torch.no_grad():
            logits = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits
            assert set(seen) >= set(cache.policy.filters), "the filter layers must preselect"
            kept = [cache.store.where(key) == "host" for layer, leaves in seen.items()
                    for key in cache.index_of(layer).fetch(leaves).keys]
            before = cache.stats()["disk_bytes_read"]
            model(logits[:, -1].argmax(-1, keepdim=True), **cache_kwargs(model, cache), use_cache=True)
            return sum(kept) / len(kept), cache.stats()["disk_bytes_read"] - before

    kept, read = first_step(tmp_path / "guessed", guess=True)
    assert kept == 1.0
    kept_by_attention, read_by_attention = first_step(tmp_path / "attention", guess=False)
    assert kept_by_attention < 0.75, kept_by_attention  # the guess is what keeps them there
    assert read < read_by_attention, (read, read_by_attention)
