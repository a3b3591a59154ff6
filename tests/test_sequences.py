"""Seeded random sequences of what a library user does to a cache: prompts, questions and decode
steps of random lengths, saves (in place or elsewhere) and reopenings with other tier budgets,
codecs and segment sizes, compaction, passes that fail part-way, and crops.

* Lossless (``full``, and ``tierkv``, ``quest`` and ``leoam`` with a budget of the whole
  context): every pass gives plain transformers' logits for the tokens the cache holds.
* Every policy: a cache saved, reopened and compacted along the way, and for those without an
  adaptive chunk tree one whose passes failed part-way, gives the logits of a twin that never
  was.

Each case found nothing on the code it was written against (40 + 64 seeds of 30 operations
when written); the seeds here keep the sequences that cover each policy and operation."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.config import CodecConfig
from tierkv.hf.model import cache_kwargs
from tierkv.policies import REGISTRY
from tinyllama import PER_TOKEN, tiny

MOST = 1700  # tokens: a sequence stops growing here (the tiny Llama holds 2048 positions)
FEEDS = ("step", "question", "prompt")


def _feed(model, cache, tokens):
    return model(tokens, **cache_kwargs(model, cache), use_cache=True).logits[0]


def _tiers(rng, path, device=None) -> TierConfig:
    return TierConfig(device_budget=device or 8 << 20, disk_dir=path,
                      host_budget=rng.choice(["1KB", "16KB", "200KB", "8MB"]),
                      segment_size=rng.choice(["64KB", "256MiB"]),
                      codec=CodecConfig(codec=rng.choice(["auto", "raw", "zstd"])))


def _length(rng, op: str) -> int:
    return {"step": 1, "question": rng.randint(2, 64), "prompt": rng.randint(65, 400)}[op]


def _croppable(*caches) -> int:
    return min(w[0].shape[1] for cache in caches for w in cache._window)


class _Broken:
    """The next forward pass of ``model`` raises before ``layer``."""

    def __init__(self, model, layer: int):
        self.hook = model.model.layers[layer].register_forward_pre_hook(self.fail)

    @staticmethod
    def fail(module, args):
        raise RuntimeError("layer broke")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.hook.remove()


@pytest.mark.parametrize("seed", range(4))
def test_a_lossless_cache_is_plain_transformers_whatever_is_done_to_it(seed, tmp_path):
    rng, layers = random.Random(seed), 4
    model, other = tiny(layers=layers), tiny(layers=layers)
    gen = torch.Generator().manual_seed(seed)
    policy = ("full", "tierkv", "quest", "leoam")[seed % 4]
    select = SelectConfig(budget=1.0, question_tokens=rng.choice([0, 64]))
    device = int(2200 * PER_TOKEN * rng.choice([1.5, 3]))  # a layer's whole context, and more
    plain, fed = DynamicCache(config=other.config), torch.zeros(1, 0, dtype=torch.long)
    path, saved = tmp_path / "kv", None
    cache = TieredCache(model, _tiers(rng, path, device), policy, select=select)
    try:
        with torch.no_grad():
            for i in range(30):
                op = rng.choices(["step", "question", "prompt", "save", "reopen", "compact",
                                  "fail", "crop"], [8, 3, 2, 1, 2, 1, 2, 3])[0]
                if fed.shape[1] > MOST:
                    break
                if not fed.shape[1] and op not in FEEDS:
                    op = "prompt"
                if op in FEEDS:
                    tokens = torch.randint(0, 64, (1, _length(rng, op)), generator=gen)
                    got, want = _feed(model, cache, tokens), _feed(other, plain, tokens)
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                    fed = torch.cat([fed, tokens], 1)
                elif op == "save":
                    saved = path if rng.random() < 0.5 else tmp_path / f"saved{i}"
                    cache.save(saved)
                elif op == "reopen" and saved is not None:
                    cache.close()
                    cache = TieredCache.open(model, saved, _tiers(rng, saved, device))
                    n, path = cache.get_seq_length(), saved
                    if n < fed.shape[1]:
                        plain.crop(n - fed.shape[1])
                        fed = fed[:, :n]
                elif op == "compact":
                    cache.compact()
                elif op == "fail":
                    with _Broken(model, rng.randrange(layers)), \
                            pytest.raises(RuntimeError, match="layer broke"):
                        _feed(model, cache, torch.randint(0, 64, (1, _length(rng, rng.choice(
                            ["step", "question", "prompt"]))), generator=gen))
                elif op == "crop" and _croppable(cache):
                    count = rng.randint(1, min(16, _croppable(cache)))
                    cache.crop(-count)
                    plain.crop(-count)
                    fed, saved = fed[:, :-count], None  # (a save may no longer be a prefix)
                assert cache.get_seq_length() == fed.shape[1]
                assert torch.equal(cache.token_ids, fed)
    finally:
        cache.close()


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_a_saved_reopened_compacted_cache_decodes_as_its_twin(policy, tmp_path):
    seed = sorted(REGISTRY).index(policy)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    select = SelectConfig(budget=rng.choice([0.1, 0.25, 64]), window=rng.choice([8, 32]),
                          sinks=rng.choice([0, 4]), question_tokens=rng.choice([0, 64]),
                          fetch_unit=rng.choice(["record", "record", "leaf"]))
    profile = {"retrieval_heads": {"1": [0], "4": [1]}, "filter_layers": [2, 4]}
    model, other = tiny(layers=6), tiny(layers=6)
    path, saved, n = tmp_path / "a", None, 0
    a = TieredCache(model, _tiers(rng, path), policy, select=select, profile=profile)
    b = TieredCache(other, _tiers(rng, tmp_path / "b"), policy, select=select, profile=profile)
    try:
        with torch.no_grad():
            for i in range(30):
                op = rng.choices(["step", "question", "prompt", "save", "reopen", "compact",
                                  "crop", "fail"], [10, 3, 2, 1, 2, 1, 3, 2])[0]
                if n > MOST:
                    break
                if not n and op not in FEEDS:
                    op = "prompt"
                if op in FEEDS:
                    count = _length(rng, op)
                    tokens = torch.randint(0, 64, (1, count), generator=gen)
                    torch.testing.assert_close(_feed(model, a, tokens), _feed(other, b, tokens),
                                               rtol=1e-5, atol=1e-5)
                    n += count
                elif op == "save":
                    saved = path if rng.random() < 0.5 else tmp_path / f"saved{i}"
                    a.save(saved)
                    saved_at = n
                elif op == "reopen" and saved is not None and saved_at == n:
                    a.close()
                    a, path = TieredCache.open(model, saved, _tiers(rng, saved)), saved
                elif op == "compact":
                    a.compact()
                elif op == "fail" and n and not a.policy.adaptive:  # (an adaptive tree
                    # keeps what a failed pass's attention taught it: README)
                    with _Broken(model, rng.randrange(6)), \
                            pytest.raises(RuntimeError, match="layer broke"):
                        _feed(model, a, torch.randint(0, 64, (1, _length(rng, rng.choice(FEEDS))),
                                                      generator=gen))
                elif op == "crop" and _croppable(a, b):
                    count = rng.randint(1, min(16, _croppable(a, b)))
                    a.crop(-count)
                    b.crop(-count)
                    n, saved = n - count, None
    finally:
        a.close()
        b.close()
