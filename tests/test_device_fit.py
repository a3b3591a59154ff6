"""A device tier too small for what a decode step would fetch, on tiny random models (no model
file read): a selection is cut to what fits and the step goes on (once warned); a layer read
whole that no longer fits is refused before the step changes anything, so the cache can be
saved and reopened with a larger device tier."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

from tierkv import DeviceBudgetWarning, SelectConfig, TierConfig, TieredCache, TierFullError
from tierkv.hf.model import cache_kwargs
from tinyllama import PER_TOKEN, ids, tiny


def test_a_selection_the_device_tier_does_not_hold_is_cut_to_what_fits(tmp_path):
    """``tierkv``'s layers 3-15 reuse filter layer 2's choice: a quarter of 1,000 tokens, 13
    layers deep, is more than a device tier that holds one layer's prompt for its prefill
    holds beside the windows. Each such fetch is cut to what fits, the first with a warning;
    they are counted and the tier never holds more than its budget. Before, the first decode
    step failed (TierFullError) and left the cache unable to go on or be saved."""
    model = tiny(layers=16)
    select = SelectConfig(budget=0.25, filter_layers=(2,))
    with TieredCache(model, TierConfig(device_budget="64MB", host_budget="64MB"), "tierkv",
                     select=select) as probe:
        assert probe.groups == [(0,), (1,), (2,), tuple(range(3, 16))]
        windows = sum(len(layers) * probe.spare_tokens(g) for g, layers in enumerate(probe.groups))
    device = (windows + 1100) * PER_TOKEN
    config = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "tierkv", select=select) as cache, torch.no_grad():
        model(ids(1000), **cache_kwargs(model, cache), use_cache=True)
        room = cache.fetch_room(3)
        assert 0 < room < cache.policy.budget(cache, 3) // 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(6):
                model(ids(1, seed=10 + step), **cache_kwargs(model, cache), use_cache=True)
        trimmed = [w for w in caught if issubclass(w.category, DeviceBudgetWarning)]
        assert len(trimmed) == 1
        assert f"holds {room} tokens of layer group 3 (layers 3-15)" in str(trimmed[0].message)
        stats = cache.stats()
        assert stats["trimmed_fetches"] >= 6 and stats["trimmed_tokens"] > 6 * room
        assert cache.store.device.peak <= device
        assert cache.get_seq_length() == 1006
        cache.save(tmp_path / "saved")


def test_a_layer_read_whole_that_outgrows_the_device_is_refused_before_the_step(tmp_path):
    """``full`` reads every layer whole. Once the sealed context passes what the device tier
    holds beside the windows, the next decode step is refused before it changes anything: the
    cache is saved, reopened with a larger device tier, and goes on to plain transformers'
    greedy tokens."""
    model = tiny()
    probe = TieredCache(model, TierConfig(device_budget="64MB", host_budget="64MB"), "full")
    spare = probe.spare_tokens(0)
    probe.close()
    device = 4 * spare * PER_TOKEN + (100 + spare) * PER_TOKEN  # room for 100 sealed tokens
    prompt = ids(90)
    small = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path / "kv")
    tokens = []
    with TieredCache(model, small, "full") as cache, torch.no_grad():
        logits = model(prompt, **cache_kwargs(model, cache), use_cache=True).logits
        assert cache.fetch_room(0) == 100
        with pytest.raises(TierFullError, match=r"reads layer group 0 \(layers 0\) whole under "
                                                r"policy 'full': its 104 sealed tokens do not fit"):
            while True:
                tokens.append(int(logits[0, -1].argmax()))
                held = cache.get_seq_length()
                logits = model(torch.tensor([[tokens[-1]]]), **cache_kwargs(model, cache),
                               use_cache=True).logits
        assert cache.get_seq_length() == held and cache.token_ids.shape[1] == held
        assert cache.store.device.peak <= device
        cache.save(tmp_path / "saved")
    larger = TierConfig(device_budget="1MB", host_budget="64MB")
    with TieredCache.open(model, tmp_path / "saved", larger) as cache, torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([[tokens[-1]]]), **cache_kwargs(model, cache), use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
    want = model.generate(prompt, max_new_tokens=len(tokens), do_sample=False)[0, 90:].tolist()
    assert tokens == want


def test_a_dense_layer_and_the_choice_after_it_take_turns_on_a_small_device(tmp_path):
    """With ``full_after_filter`` the choice of filter layer 2 for layers 4-15 was prefetched
    while layer 3 attended its whole context, and the two together needed more than a device
    tier holding either (TierFullError at the first step). Now the choice's prefetch gives way
    to the dense layer's fetch and is fetched when layer 4 asks: the same logits as on a large
    device tier."""
    model = tiny(layers=16)
    select = SelectConfig(budget=0.1, filter_layers=(2,), full_after_filter=True)
    logits = []
    for device in ("64MB", None):
        if device is None:
            with TieredCache(model, TierConfig(device_budget="64MB", host_budget="64MB"), "omnikv",
                             select=select) as probe:
                assert probe.groups == [(0,), (1,), (2,), (3,), tuple(range(4, 16))]
                windows = sum(len(layers) * probe.spare_tokens(g)
                              for g, layers in enumerate(probe.groups))
            device = (windows + 1400) * PER_TOKEN
        config = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path / "kv")
        with TieredCache(model, config, "omnikv", select=select) as cache, torch.no_grad(), \
                warnings.catch_warnings():
            warnings.simplefilter("error", DeviceBudgetWarning)
            model(ids(1000), **cache_kwargs(model, cache), use_cache=True)
            steps = [model(ids(1, seed=10 + step), **cache_kwargs(model, cache), use_cache=True).logits
                     for step in range(4)]
            logits.append(torch.cat(steps))
            if isinstance(device, int):
                assert cache.store.device.peak <= device
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def windows_of(model, policy: str, select: SelectConfig | None = None) -> int:
    """Tokens the recent windows of ``model``'s layers reserve under ``policy``."""
    with TieredCache(model, TierConfig(device_budget="64MB", host_budget="64MB"), policy,
                     select=select) as probe:
        return sum(len(layers) * probe.spare_tokens(g) for g, layers in enumerate(probe.groups))


def test_streaming_keeps_its_sinks_and_the_most_recent_tokens_that_fit(tmp_path):
    """``streaming`` at a 99 % budget asks for nearly all of a layer; a device tier holding
    less beside the windows cuts the oldest recent tokens (one warning) and the steps go on."""
    model = tiny()
    select = SelectConfig(budget=0.99)
    device = (windows_of(model, "streaming", select) + 1000) * PER_TOKEN
    config = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "streaming", select=select) as cache, torch.no_grad(), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids(1000), **cache_kwargs(model, cache), use_cache=True)
        assert cache.fetch_room(0) < cache.indexes[0].sealed
        for step in range(3):
            model(ids(1, seed=10 + step), **cache_kwargs(model, cache), use_cache=True)
        assert sum(issubclass(w.category, DeviceBudgetWarning) for w in caught) == 1
        assert cache.stats()["trimmed_fetches"] == 3 * 4 and cache.store.device.peak <= device
        cache.save(tmp_path / "saved")


def test_a_group_whose_sink_records_do_not_fit_is_refused_before_the_step(tmp_path):
    """Whatever a group selects, the records holding its sink tokens come first: a device tier
    without room for them beside the windows refuses the step before it changes anything, with
    a device budget that then holds every group's least."""
    model = tiny(layers=16)
    select = SelectConfig(budget=0.05, filter_layers=(2,))
    device = (windows_of(model, "omnikv", select) + 420) * PER_TOKEN
    config = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "omnikv", select=select) as cache, torch.no_grad():
        model(ids(180), **cache_kwargs(model, cache), use_cache=True)
        assert cache.fetch_room(3) < 8
        with pytest.raises(TierFullError, match=r"brings layer group 3 \(layers 3-15\)'s sink "
                                                r"tokens under policy 'omnikv': the 8 tokens") as err:
            model(ids(1, seed=10), **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == 180
        cache.save(tmp_path / "saved")
    need = int(re.search(r"a device budget of at least (\d+) B", str(err.value)).group(1))
    larger = TierConfig(device_budget=need, host_budget="64MB")
    with TieredCache.open(model, tmp_path / "saved", larger) as cache, torch.no_grad():
        for step in range(3):
            model(ids(1, seed=10 + step), **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == 183 and cache.store.device.peak <= need


def test_a_prompt_after_a_decode_step_takes_the_room_of_its_prefetch(tmp_path):
    """A decode step ends by prefetching layer 0 for the next step; when the next forward pass
    is a prompt instead, its prefill needs that room: the prefetch gives way (before, the
    prompt failed part-way, the cache broken)."""
    model = tiny(layers=8)
    device = (windows_of(model, "full") + 800) * PER_TOKEN
    config = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        model(ids(400), **cache_kwargs(model, cache), use_cache=True)
        model(ids(1, seed=10), **cache_kwargs(model, cache), use_cache=True)
        assert ("prefetch", 0) in cache._step
        model(ids(40, seed=99), **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == 441 and cache.store.device.peak <= device
        cache.save(tmp_path / "saved")


@pytest.mark.parametrize("policy", ["quest", "omnikv"])
def test_a_budget_above_the_sealed_context_is_no_cut(policy):
    """A token budget larger than what a group has sealed fetches the whole group, which the
    device tier holds: no warning, nothing counted, the logits of a large device tier."""
    model = tiny(layers=4)
    select = SelectConfig(budget=4096, filter_layers=(1,))
    logits = []
    for device in ((windows_of(model, policy, select) + 1300) * PER_TOKEN, "64MB"):
        config = TierConfig(device_budget=device, host_budget="64MB")
        with TieredCache(model, config, policy, select=select) as cache, torch.no_grad(), \
                warnings.catch_warnings():
            warnings.simplefilter("error", DeviceBudgetWarning)
            model(ids(600), **cache_kwargs(model, cache), use_cache=True)
            logits.append(torch.cat([model(ids(1, seed=10 + step), **cache_kwargs(model, cache),
                                           use_cache=True).logits for step in range(3)]))
            assert cache.stats()["trimmed_fetches"] == 0
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_a_prompt_whose_prefill_does_not_fit_is_refused_before_it_runs(tmp_path):
    """A second prompt is prefilled one layer at a time over the layer's whole context. Where
    the device tier cannot hold that beside the other layers' windows, the prompt is refused
    before any layer runs (before, its prefill failed part-way and the cache was lost); reopened
    with the device budget the error names, the same prompt goes through."""
    model = tiny(layers=8)
    device = (windows_of(model, "full") + 410) * PER_TOKEN  # a step's 368 sealed tokens fit
    config = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path / "kv")
    question = ids(100, seed=99)
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        model(ids(400), **cache_kwargs(model, cache), use_cache=True)
        model(ids(1, seed=10), **cache_kwargs(model, cache), use_cache=True)
        with pytest.raises(TierFullError, match="a prompt of 100 tokens is prefilled one layer at "
                                                "a time") as err:
            model(question, **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == 401
        cache.save(tmp_path / "saved")
    need = int(re.search(r"a device budget of at least (\d+) B", str(err.value)).group(1))
    with TieredCache.open(model, tmp_path / "saved", TierConfig(device_budget=need,
                                                                  host_budget="64MB")) as cache, \
            torch.no_grad():
        model(question, **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == 501 and cache.store.device.peak <= need


def test_a_document_reopened_with_a_smaller_window_counts_the_windows_it_holds(tmp_path):
    """Reopened with ``window=4``, a document's restored windows (32 tokens) are larger than
    the new window's buffers: the room a selection is cut to counts them as they are, and the
    steps go on (before, a selection cut to the room did not fit beside them: TierFullError
    mid-step)."""
    model = tiny(layers=16)
    select = SelectConfig(budget=0.5, filter_layers=(2,))
    config = TierConfig(device_budget="64MB", host_budget="64MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "tierkv", select=select) as cache, torch.no_grad():
        model(ids(1000), **cache_kwargs(model, cache), use_cache=True)
        cache.save(tmp_path / "saved")
    small = SelectConfig(budget=0.5, filter_layers=(2,), window=4)
    device = (windows_of(model, "tierkv", small) + 1300) * PER_TOKEN
    with TieredCache.open(model, tmp_path / "saved", TierConfig(device_budget=device,
                                                                  host_budget="64MB"),
                          select=small) as cache, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeviceBudgetWarning)  # the half budget is cut: expected
        for step in range(3):
            model(ids(1, seed=10 + step), **cache_kwargs(model, cache), use_cache=True)
        assert cache.stats()["trimmed_fetches"] > 0 and cache.store.device.peak <= device
        cache.save(tmp_path / "again")
