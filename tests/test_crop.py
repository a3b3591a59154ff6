"""``TieredCache.crop``: the newest tokens taken back, as transformers' assisted and prompt-lookup
decoding do after each pass that verifies drafted tokens (``tierkv/hf/crop.py``)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.hf.model import cache_kwargs
from tierkv.policies import REGISTRY
from tinyllama import ids, tiny

PROFILE = {"retrieval_heads": {"1": [0]}}


def _config(tmp_path, name="kv"):
    return TierConfig(device_budget="4MB", host_budget="64KB", disk_dir=tmp_path / name)


def _feed(model, cache, tokens):
    return model(tokens, **cache_kwargs(model, cache), use_cache=True).logits[0]


def test_a_cropped_cache_goes_on_as_one_that_never_saw_the_tokens(tmp_path):
    model, other = tiny(), tiny()
    plain = DynamicCache(config=other.config)
    prompt, drafted = ids(300), ids(6, seed=2)
    with TieredCache(model, _config(tmp_path), "full") as cache, torch.no_grad():
        _feed(model, cache, prompt)
        _feed(model, cache, drafted)
        assert cache.stats()["disk_records"] > 0  # older tokens sealed, the drafted ones not
        cache.crop(-4)
        assert cache.get_seq_length() == 302 and cache.token_ids.tolist() == \
            torch.cat([prompt, drafted[:, :2]], 1).tolist()
        _feed(other, plain, torch.cat([prompt, drafted[:, :2]], 1))
        for seed in range(40):  # past the window: what it sealed after the crop is right too
            token = ids(1, seed=10 + seed)
            torch.testing.assert_close(_feed(model, cache, token), _feed(other, plain, token),
                                       rtol=1e-5, atol=1e-5)
        cache.crop(0)
        assert cache.get_seq_length() == 342
        cache.save(tmp_path / "saved")
    with TieredCache.open(model, tmp_path / "saved", _config(tmp_path, "again")) as cache, \
            torch.no_grad():
        token = ids(1, seed=99)
        torch.testing.assert_close(_feed(model, cache, token), _feed(other, plain, token),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("held", [0, 600])
def test_assisted_and_prompt_lookup_decoding_give_greedy_tokens(held, tmp_path):
    """On a fresh cache, and on one holding part of the prompt (a document, then a question):
    transformers feeds an assisted generate's first pass whole, the held tokens too (a
    DynamicCache then holds them twice); through a TieredCache it feeds only the new ones, and
    ids that do not continue the cache's are refused."""
    model, draft = tiny(), tiny(layers=2, seed=3)
    base = ids(300)
    prompt = torch.cat([base, base[:, :150], base], 1)  # repeats: prompt lookup finds drafts
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=30, do_sample=False)
        for name, kwargs in (("lookup", dict(prompt_lookup_num_tokens=5)),
                             ("assisted", dict(assistant_model=draft))):
            with TieredCache(model, _config(tmp_path, name), "full") as cache:
                if held:
                    _feed(model, cache, prompt[:, :held])
                got = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=30,
                                     do_sample=False, **kwargs)
                assert got.tolist() == want.tolist()
                assert cache.token_ids.tolist() == got[:, :-1].tolist()
                other = got.clone()
                other[0, 10] = (other[0, 10] + 1) % 64
                with pytest.raises(ValueError, match="differ from the cache's at position 10"):
                    model.generate(other, **cache_kwargs(model, cache), max_new_tokens=2, **kwargs)
                assert cache.get_seq_length() == got.shape[1] - 1


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_every_policy_decodes_with_prompt_lookup_and_goes_on(policy, tmp_path):
    """Lossy policies keep what the rejected tokens' attention taught them of older positions
    (h2o's accumulated attention, the selectors' running scores): their tokens may differ from
    plain decoding's, but the cache stays whole and within its device budget."""
    model = tiny()
    base = ids(300)
    prompt = torch.cat([base, base[:, :150], base], 1)
    select = SelectConfig(selector="uniform")
    with TieredCache(model, _config(tmp_path), policy, select=select, profile=PROFILE) as cache, \
            torch.no_grad():
        got = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=24,
                             prompt_lookup_num_tokens=5, do_sample=False)
        assert cache.get_seq_length() == got.shape[1] - 1
        more = model.generate(got, **cache_kwargs(model, cache), max_new_tokens=40, do_sample=False)
        assert cache.get_seq_length() == more.shape[1] - 1
        assert cache.stats()["device_peak_bytes"] <= 4 * 10**6


def test_a_crop_past_the_recent_windows_or_of_a_length_is_refused(tmp_path):
    model = tiny()
    with TieredCache(model, _config(tmp_path), "full", select=SelectConfig(window=16)) as cache, \
            torch.no_grad():
        _feed(model, cache, ids(300))
        held = min(cache._window[layer][0].shape[1] for layer in range(4))
        assert 16 <= held < 300
        before = cache.token_ids.clone()
        with pytest.raises(ValueError, match=rf"of which the newest {held} are in every layer's"):
            cache.crop(-(held + 1))
        with pytest.raises(ValueError, match=r"crop\(5\): a TieredCache takes a negative count"):
            cache.crop(5)
        for wrong in (-1.0, True, "2"):
            with pytest.raises(TypeError, match="expected an int"):
                cache.crop(wrong)
        assert cache.get_seq_length() == 300 and torch.equal(cache.token_ids, before)
        cache.crop(torch.tensor(-1))  # as an int (a count transformers may leave a tensor)
        assert cache.get_seq_length() == 299
        held -= 1
        cache.crop(-held)  # all the windows hold: the device tier's window bytes stay reserved
        assert cache.get_seq_length() == 299 - held
        _feed(model, cache, ids(1, seed=5))


def test_what_a_policy_holds_by_position_is_cut_with_the_tokens(tmp_path):
    """Decode steps taken back (transformers' own decoding loop crops one it ran ahead): the
    selectors' running scores cover the tokens the cache holds, and h2o, whose steps evicted
    positions that are in the recent window again, evicts none of the window (a cache that never
    saw the steps never does)."""
    model = tiny()
    select = SelectConfig(selector="uniform", budget=0.2, window=16)
    for policy in ("omnikv", "h2o"):
        with TieredCache(model, _config(tmp_path, policy), policy, select=select) as cache, \
                torch.no_grad():
            _feed(model, cache, ids(300))
            for seed in range(12):
                _feed(model, cache, ids(1, seed=seed))
            held = cache.policy._smoothed if policy == "omnikv" else cache.policy._evicted
            if policy == "h2o":  # the steps evicted positions 12 before the window's start
                assert all(bool(gone[:, 296 - 12:296].any()) for gone in held.values())
            cache.crop(-12)
            held = cache.policy._smoothed if policy == "omnikv" else cache.policy._evicted
            assert held and all(t.shape[-1] <= 300 for t in held.values())
            if policy == "h2o":
                assert not any(bool(gone[:, 300 - 16:].any()) for gone in held.values())
            for seed in range(3):
                _feed(model, cache, ids(1, seed=70 + seed))
            assert cache.get_seq_length() == 303


def test_drafts_a_crop_could_not_take_back_are_refused_before_their_pass(tmp_path):
    model = tiny()
    base = ids(300)
    prompt = torch.cat([base, base[:, :150], base], 1)
    with TieredCache(model, _config(tmp_path), "full", select=SelectConfig(window=8)) as cache, \
            torch.no_grad():
        with pytest.raises(ValueError, match=r"verifying 12 drafted tokens: a TieredCache takes "
                                             r"back at most 8 after it"):
            model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=20,
                           prompt_lookup_num_tokens=12, do_sample=False)
        assert cache.get_seq_length() == 0  # nothing was fed
        want = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=20,
                              prompt_lookup_num_tokens=8, do_sample=False)
    with torch.no_grad():
        assert want.tolist() == model.generate(prompt, max_new_tokens=20, do_sample=False).tolist()


def test_continuing_a_cache_without_drafts_is_as_before(tmp_path):
    """What only assisted decoding's first pass gets (its held ids sliced off) is not done to
    others: a chunked prefill (prefill_chunk_size), and only the new ids with an attention_mask
    over the whole sequence, transformers' own way to continue a cache."""
    model, other = tiny(), tiny()
    held = ids(10, seed=1)
    with torch.no_grad():
        for name, new in (("chunked", ids(100, seed=2)), ("mask", ids(40, seed=2))):
            whole = torch.cat([held, new], 1)
            want = other.generate(whole, max_new_tokens=6, do_sample=False)[0, whole.shape[1]:]
            with TieredCache(model, _config(tmp_path, name), "full") as cache:
                _feed(model, cache, held)
                if name == "chunked":
                    out = model.generate(whole, **cache_kwargs(model, cache), max_new_tokens=6,
                                         do_sample=False, prefill_chunk_size=32)
                else:
                    out = model.generate(new, attention_mask=torch.ones_like(whole),
                                         **cache_kwargs(model, cache), max_new_tokens=6,
                                         do_sample=False)
                assert out[0, -6:].tolist() == want.tolist()
                assert cache.get_seq_length() == whole.shape[1] + 5


def test_a_closed_cache_is_neither_cropped_compacted_nor_saved(tmp_path):
    model = tiny()
    cache = TieredCache(model, _config(tmp_path), "full")
    with torch.no_grad():
        _feed(model, cache, ids(100))
    cache.close()
    for use in (lambda: cache.crop(-1), lambda: cache.save(tmp_path / "saved"), cache.compact):
        with pytest.raises(RuntimeError, match="this TieredCache is closed"):
            use()
