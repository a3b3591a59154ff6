"""Passes verifying drafted tokens (assisted and prompt-lookup decoding) attend as decode steps
(``TieredCache.verifying``): each drafted token sees what the step selects and the recent window
up to its own token, the selection chosen by all of the pass's queries, instead of going through
a question's path (the selection's budget four times over, every chosen token copied)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tierkv import DeviceBudgetWarning, SelectConfig, TierConfig, TieredCache, TierFullError
from tierkv.config import ChunkConfig
from tierkv.hf.groups import GroupIndex
from tierkv.hf.model import cache_kwargs
from tierkv.policies.omnikv import _by_position
from tinyllama import ids, tiny


def _feed(model, cache, tokens):
    return model(tokens, **cache_kwargs(model, cache), use_cache=True).logits[0]


@pytest.mark.parametrize("policy", ["full", "tierkv", "omnikv", "quest", "leoam"])
def test_a_verifying_pass_is_one_decode_step_each_token_seeing_up_to_its_own(policy, tmp_path):
    """Through the whole context (``budget=1.0``) a selecting policy loses nothing: every
    drafted token's logits are plain transformers', from one decode step (not a question);
    a crop takes the rejected tokens back, and decoding goes on as plain transformers'."""
    model, other = tiny(), tiny()
    plain = DynamicCache(config=other.config)
    config = TierConfig(device_budget="4MB", host_budget="16KB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, policy, select=SelectConfig(budget=1.0)) as cache, \
            torch.no_grad():
        prompt = ids(300)
        _feed(model, cache, prompt)
        _feed(other, plain, prompt)
        for seed in range(3):
            token = ids(1, seed=20 + seed)
            torch.testing.assert_close(_feed(model, cache, token), _feed(other, plain, token),
                                       rtol=1e-5, atol=1e-5)
        assert cache.stats()["disk_records"] > 0
        steps = cache.steps
        cache.verifying = True
        drafted = ids(7, seed=9)
        torch.testing.assert_close(_feed(model, cache, drafted), _feed(other, plain, drafted),
                                   rtol=1e-5, atol=1e-5)
        assert cache.steps == steps + 1 and not cache.asking
        cache.verifying = False
        cache.crop(-4)
        plain.crop(-4)
        for seed in range(70):  # past the window: sealed after the verifying pass, still right
            token = ids(1, seed=40 + seed)
            torch.testing.assert_close(_feed(model, cache, token), _feed(other, plain, token),
                                       rtol=1e-5, atol=1e-5)


def test_prompt_lookup_verifies_where_a_question_would_not_fit(tmp_path):
    """A question holds one layer's whole context on the device while it attends, a decode
    step only what it selects: reopened with a device tier too small for the first, a document
    is refused a question of seven tokens (nothing changed), and still generates with prompt
    lookup, each pass drafting up to six tokens (the first too: besides its drafts it brings
    only the prompt's last token)."""
    model = tiny()
    base = ids(500)
    prompt = torch.cat([base, base[:, :300], base, base[:, :200]], 1)
    roomy = TierConfig(device_budget="4MB", host_budget="64KB", disk_dir=tmp_path / "kv")
    with TieredCache(model, roomy, "tierkv") as cache, torch.no_grad():
        _feed(model, cache, prompt[:, :-1])  # the next token's logits come with the drafts'
        cache.save(tmp_path / "saved")
    small = TierConfig(device_budget="200KB", host_budget="64KB", disk_dir=tmp_path / "again")
    with TieredCache.open(model, tmp_path / "saved", small) as cache, torch.no_grad():
        held = cache.get_seq_length()
        with pytest.raises(TierFullError, match="a prompt of 7 tokens is prefilled one layer"):
            _feed(model, cache, base[:, 200:207])
        assert cache.get_seq_length() == held
        steps = cache.steps
        out = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=40,
                             min_new_tokens=40, prompt_lookup_num_tokens=6, do_sample=False)
        passes = cache.steps - steps
        assert out.shape[1] == prompt.shape[1] + 40 and cache.get_seq_length() == out.shape[1] - 1
        assert passes < 39  # drafts were accepted: fewer passes than tokens
        assert cache.stats()["device_peak_bytes"] <= 200_000 and not cache.verifying


def test_verifying_is_set_only_while_an_assisted_generate_runs(tmp_path):
    """Set for the passes after an assisted generate's first, unset when it returns or
    raises; a plain generate's passes never verify."""
    model = tiny()
    base = ids(300)
    prompt = torch.cat([base, base[:, :150], base], 1)
    config = TierConfig(device_budget="4MB", host_budget="64KB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "tierkv", select=SelectConfig(window=8)) as cache, \
            torch.no_grad():
        seen = []
        hook = model.model.layers[0].register_forward_pre_hook(
            lambda module, args: seen.append(cache.verifying))
        try:
            out = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=12,
                                 prompt_lookup_num_tokens=6, do_sample=False)
            assert seen[0] is False and any(seen[1:]) and not cache.verifying
            seen.clear()
            with pytest.raises(ValueError, match="verifying 9 drafted tokens"):
                model.generate(out, **cache_kwargs(model, cache), max_new_tokens=12,
                               prompt_lookup_num_tokens=9, do_sample=False)
            assert not cache.verifying
            seen.clear()
            model.generate(out, **cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
            assert seen and not any(seen)
        finally:
            hook.remove()


def test_a_verifying_pass_leaves_the_windows_room_for_its_drafts(tmp_path):
    """A fetch cut to what the device tier holds beside the recent windows counts them with
    the pass's drafts: the windows grow by them beyond a decode step's one token (before, the
    pass ran out of room part-way, TierFullError, when a fetch filled the tier)."""
    model = tiny(layers=6)
    roomy = TierConfig(device_budget="4MB", host_budget="32KB", disk_dir=tmp_path / "kv")
    with TieredCache(model, roomy, "tierkv", select=SelectConfig(budget=1.0)) as cache, \
            torch.no_grad():
        _feed(model, cache, ids(600))
        cache.save(tmp_path / "saved")
    tight = TierConfig(device_budget="120KB", host_budget="32KB", disk_dir=tmp_path / "again")
    with TieredCache.open(model, tmp_path / "saved", tight) as cache, torch.no_grad(), \
            pytest.warns(DeviceBudgetWarning):
        for seed in range(3):
            _feed(model, cache, ids(1, seed=20 + seed))
        assert cache.stats()["trimmed_fetches"] > 0  # fetches fill the tier's room
        for seed in range(4):
            cache.verifying = True
            _feed(model, cache, ids(12, seed=30 + seed))
            cache.verifying = False
            cache.crop(-5)
        assert cache.stats()["device_peak_bytes"] <= 120_000


def _live(tmp_path, device="4MB"):
    model = tiny(layers=6)
    config = TierConfig(device_budget=device, host_budget="64KB", disk_dir=tmp_path / "kv")
    cache = TieredCache(model, config, "tierkv", select=SelectConfig(budget=0.1))
    with torch.no_grad():
        _feed(model, cache, ids(900))
        _feed(model, cache, ids(1, seed=5))
    return cache


def test_a_verifying_pass_brings_what_each_of_its_tokens_would_choose_alone(tmp_path,
                                                                           monkeypatch):
    """Chosen together, a pass's tokens would share one step's budget: a filter layer chooses,
    for the group after it, the leaves each of its tokens would choose alone within the budget,
    all of them where the device tier holds their records, else as many as it holds, chosen by
    the tokens' largest weights."""
    with _live(tmp_path) as cache:
        policy = cache.policy
        layer = policy.filters[0]
        target = policy._target(cache, layer)
        index, budget = cache.indexes[target], policy.budget(cache, target)
        n = cache.layer_length(layer)
        mass = torch.rand(3, n, generator=torch.Generator().manual_seed(0)) * 1e-3
        for row, start in enumerate((100, 400, 700)):  # each token singles out its own span
            mass[row, start:start + 60] = 1.0
        positions = torch.arange(n)
        peaks = _by_position(cache, layer, mass.amax(0), positions)
        leaves = policy._chosen_each(cache, layer, target, mass, positions, peaks)
        assert bool((leaves.diff() > 0).all())
        for row in mass:
            alone = policy._fill(index, _by_position(cache, layer, row, positions), budget)
            assert set(alone.tolist()) <= set(leaves.tolist())
        assert index.fetch(leaves).tokens > budget  # more than one budget: each got its own
        monkeypatch.setattr(cache, "fetch_room", lambda group: budget + 8)
        held = policy._chosen_each(cache, layer, target, mass, positions, peaks)
        assert torch.equal(held, policy._fill(index, peaks, budget + 8))


def test_a_verifying_pass_preselects_each_of_its_tokens_candidates(tmp_path, monkeypatch):
    """A preselecting layer's candidates for a verifying pass: each token's own (as its decode
    step would rank them), together where the device tier holds them, else those all of the
    tokens' query heads rank first within one step's number."""
    with _live(tmp_path, device="300KB") as cache:  # the filter layer's KV outgrows a quarter
        policy = cache.policy
        layer = policy.filters[0]
        assert policy.preselects(cache, layer)
        q = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))  # (heads, t, dim)
        leaves = policy._candidates_each(cache, layer, q)
        for i in range(3):
            alone = policy._candidates(cache, layer, q[:, i], fetching=False)
            assert set(alone.tolist()) <= set(leaves.tolist())
        monkeypatch.setattr(cache, "fetch_room", lambda group: 1)
        with pytest.warns(DeviceBudgetWarning):  # (a step's own fetch cut to that room)
            together = policy._candidates_each(cache, layer, q)
            assert torch.equal(together, policy._candidates(cache, layer, q.reshape(-1, 8)))


def test_each_tokens_bound_ranking_is_its_own():
    """``GroupIndex.bound_scores_each`` ranks the leaves for each query token as
    ``bound_scores`` does for that token alone, in one pass over the bounds."""
    index = GroupIndex("doc", 0, 3, 64, ChunkConfig())
    keys = torch.randn(3, 400, 64, generator=torch.Generator().manual_seed(0))
    index.add([(a, min(a + 32, 400)) for a in range(0, 400, 32)], keys)
    q = torch.randn(9, 5, 64, generator=torch.Generator().manual_seed(1))
    each = index.bound_scores_each(q)
    assert each.shape == (5, len(index))
    for i in range(5):
        torch.testing.assert_close(each[i], index.bound_scores(q[:, i]), rtol=0, atol=1e-5)


def test_a_verifying_pass_longer_than_the_window_is_refused_before_it_runs(tmp_path):
    model = tiny()
    config = TierConfig(device_budget="4MB", host_budget="64KB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "tierkv", select=SelectConfig(window=8)) as cache, \
            torch.no_grad():
        _feed(model, cache, ids(300))
        cache.verifying = True
        with pytest.raises(ValueError, match="verifying 9 drafted tokens"):
            _feed(model, cache, ids(10, seed=3))
        assert cache.get_seq_length() == 300
        _feed(model, cache, ids(9, seed=3))  # eight drafts: a crop takes them back
        cache.crop(-8)
        assert cache.get_seq_length() == 301
