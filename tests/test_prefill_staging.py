"""A prompt that continues a cache attends over every layer's sealed KV: what it reads of it from
disk stays within the host budget (tiny random Llamas, no model file read).

Records hold a whole layer group. The prefill held all of a group's records at once, and the
next group's read ahead: with ``tierkv``'s 13-layer group below, 13 layers of KV beside a host
tier sized for 3. It now keeps, of what it reads from disk, the slices of as many of the group's
layers as the host budget holds, reading the group again for the rest."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import tierkv.hf.prefill as prefill
from tierkv import SelectConfig, TierConfig, TieredCache
from tinyllama import PER_TOKEN, ids, tiny

# groups (0,) (1,) (2,) (3..15); a continuing prompt attends all of its context
SELECT = SelectConfig(budget=0.25, filter_layers=(2,), question_tokens=0)


class Watch:
    """Bytes the prefill holds that no memory tier holds (storages of the staged and read-ahead
    parts that are not a tier's blocks), their most at any layer, and the passes read."""

    def __init__(self, monkeypatch, cache):
        self.cache, self.most, self.passes = cache, 0, []
        sealed, stage = prefill.sealed_layer_kv, prefill._stage

        def watched_sealed(cache, layer, window, wanted=None):
            out = sealed(cache, layer, window, wanted)
            if cache is self.cache:
                self.most = max(self.most, self.held())
            return out

        def watched_stage(cache, g, spec, layers):
            if cache is self.cache:
                self.passes.append((g, layers))
            return stage(cache, g, spec, layers)

        monkeypatch.setattr(prefill, "sealed_layer_kv", watched_sealed)
        monkeypatch.setattr(prefill, "_stage", watched_stage)

    def held(self) -> int:
        cache = self.cache
        keys = [key for index in cache.indexes for key in index.fetch(None).keys]
        tiers = {t.untyped_storage().data_ptr() for block, _ in cache.store.locate(keys)
                 if block is not None for t in (block.keys, block.values)}
        parts = list(cache.prefill_staged.parts) if cache.prefill_staged is not None else []
        ahead = cache.prefill_ahead
        if ahead is not None:
            parts += ahead[3].result()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for part in parts for t in part}
        return sum(n for ptr, n in storages.items() if ptr not in tiers)


def continued(model, config, tmp_path, monkeypatch=None):
    """Logits of a second prompt after a first one and two decode steps, and the Watch."""
    with TieredCache(model, config, "tierkv", select=SELECT) as cache, torch.no_grad():
        assert cache.groups[3] == tuple(range(3, 16))
        model(ids(600), cache=cache, use_cache=True)
        for step in range(2):
            model(ids(1, seed=10 + step), cache=cache, use_cache=True)
        watch = Watch(monkeypatch, cache) if monkeypatch is not None else None
        logits = model(ids(40, seed=3), cache=cache, use_cache=True).logits
        assert cache.store.host.peak <= config.host_budget
    return logits, watch


def test_a_continuing_prompt_holds_what_it_reads_from_disk_within_the_host_budget(tmp_path,
                                                                                 monkeypatch):
    host = 3 * 610 * PER_TOKEN  # three layers of the sealed context
    small = TierConfig(device_budget="64MB", host_budget=host, disk_dir=tmp_path / "small")
    logits, watch = continued(tiny(16), small, tmp_path, monkeypatch)
    large = TierConfig(device_budget="64MB", host_budget="64MB", disk_dir=tmp_path / "large")
    reference, _ = continued(tiny(16), large, tmp_path)
    assert 0 < watch.most <= host  # before: 13 layers of records held at once
    group3 = [layers for g, layers in watch.passes if g == 3]
    assert len(group3) >= 4 and sorted(sum(group3, ())) == list(range(3, 16))
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)


def test_a_continuing_prompt_gives_the_logits_of_one_prefill_of_both(tmp_path):
    """In passes or not, the second prompt's layers attend over every sealed token exactly:
    its logits are plain transformers' over both prompts at once (summation order aside)."""
    model = tiny(16)
    first, second = ids(600), ids(40, seed=3)
    with torch.no_grad():
        plain = model(torch.cat([first, second], dim=1), cache=DynamicCache(),
                      use_cache=True).logits[:, 600:]
    for name, host in (("passes", 3 * 610 * PER_TOKEN), ("whole", 64 << 20)):
        config = TierConfig(device_budget="64MB", host_budget=host, disk_dir=tmp_path / name)
        with TieredCache(model, config, "tierkv", select=SELECT) as cache, torch.no_grad():
            model(first, cache=cache, use_cache=True)
            logits = model(second, cache=cache, use_cache=True).logits
        torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("host_layers", [1, 13])
def test_a_reopened_document_read_in_passes_answers_as_read_whole(tmp_path, host_layers):
    """A saved document reopened: all of its records are on disk. With a host tier of one layer,
    every layer of the 13-layer group is its own pass; the next prompt's logits are the same."""
    model = tiny(16)
    saved = tmp_path / "saved"
    config = TierConfig(device_budget="64MB", host_budget="64MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "tierkv", select=SELECT) as cache, torch.no_grad():
        model(ids(600), cache=cache, use_cache=True)
        cache.save(saved)
    outs = []
    for host in (host_layers * 605 * PER_TOKEN, 64 << 20):
        config = TierConfig(device_budget="64MB", host_budget=host)
        with TieredCache.open(model, saved, config, "tierkv", select=SELECT) as cache, \
                torch.no_grad():
            outs.append(model(ids(40, seed=3), cache=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_with_a_lossy_disk_codec_the_read_ahead_does_not_change_what_a_prompt_sees(tmp_path,
                                                                                   monkeypatch):
    """A group's seal spills host records, the next group's among them, to disk as int4. The
    next group read ahead before the seal got the host's exact copies, after it the lossy disk
    copies: logits hung on the reader thread's timing (1.3e-4 apart with it 0.3 s late). With a
    lossy codec allowed the next group is read after the seal, whatever the timing."""
    import threading
    import time

    from tierkv.config import CodecConfig

    model, stage = tiny(16), prefill._stage

    def late(*args):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return stage(*args)

    outs = []
    for name, delay in (("prompt", False), ("late", True)):
        monkeypatch.setattr(prefill, "_stage", late if delay else stage)
        config = TierConfig(device_budget="64MB", host_budget=3 * 610 * PER_TOKEN,
                            disk_dir=tmp_path / name,
                            codec=CodecConfig(codec="int4", allow_lossy=True))
        with TieredCache(model, config, "tierkv", select=SELECT) as cache, torch.no_grad():
            model(ids(600), cache=cache, use_cache=True)
            outs.append([model(ids(200, seed=seed), cache=cache, use_cache=True).logits
                         for seed in (3, 4)])
    for prompt, late_one in zip(*outs):
        torch.testing.assert_close(prompt, late_one, rtol=0, atol=0)
