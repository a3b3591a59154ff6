"""A CPU decode step reads its fetched records where the tiers hold them (tierkv.scattered)."""
from __future__ import annotations

import collections

import pytest
import torch

import tierkv.kernels
import tierkv.scattered
from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.pipeline import Pipeline
from tierkv.textgen import make_document
from tierkv.hf.model import cache_kwargs

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(tierkv.kernels.decode_attend_parts is None,
                                 reason="tierkv._native's kernels are not built for this CPU")]


@pytest.mark.parametrize("unit", ["record", "leaf"])
def test_reading_in_place_decodes_as_the_packed_blocks_do(model_and_tok, monkeypatch, unit):
    """``tierkv`` at 1.5K tokens with an 8 MB device tier (layers 0, 1 and the filter layers
    preselect, the others read their filter layer's choice, trees fold every 4 steps): the same
    logits, in place or packed, over 10 teacher-forced steps, and the in-place cache's groups
    are delivered unpacked; with leaves as the fetch unit, leaf subsets of records
    (``Fetch.keep``) too."""
    model, tok = model_and_tok
    ids = tok(make_document(tok, 1600, 5), return_tensors="pt")["input_ids"][:, :1500]
    tables = []
    made = tierkv.scattered.group_table

    def spy(block, keep):
        tables.append(keep is not None)
        return made(block, keep)

    monkeypatch.setattr(tierkv.scattered, "group_table", spy)
    logits = {}
    config = TierConfig(device_budget="8MB", host_budget="1GB")  # preselects past ~1370 tokens
    with torch.no_grad():
        follow = None
        for in_place in (False, True):
            with TieredCache(model, config, "tierkv", select=SelectConfig(fetch_unit=unit)) as cache:
                assert cache.in_place  # a CPU with the kernel built
                cache.in_place = in_place
                out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
                assert cache.policy.preselects(cache, 0)  # its fetch waits for its query
                steps = [out.logits[0, -1]]
                follow = follow or [int(steps[0].argmax())]
                for i in range(10):
                    token = torch.tensor([[follow[i]]])
                    steps.append(model(token, **cache_kwargs(model, cache), use_cache=True).logits[0, -1])
                    # each group's records are let go after its last layer, tables too
                    assert not [key for key in cache._step if key[0] in ("fetch", "table")]
                    if not in_place:
                        follow.append(int(steps[-1].argmax()))
                logits[in_place] = torch.stack(steps)
                if not in_place:
                    assert not tables  # packed: no table was made
    assert len(tables) == 10 * 8  # a table per group a step
    assert any(tables) is (unit == "leaf")
    assert torch.allclose(logits[True], logits[False], atol=1e-3), \
        (logits[True] - logits[False]).abs().max()
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


def test_a_group_that_asks_its_last_records_again_reads_the_ones_it_kept(model_and_tok,
                                                                       monkeypatch):
    """``tierkv`` at 1.5K tokens with an 8 MB device tier (layers 0, 1 and the filter layers
    preselect): a preselecting group whose query asks the records it read last step reads
    those, kept, instead of fetching them again (a worker ranks them as read); the same logits
    as a cache that fetches them every step, over 10 steps."""
    model, tok = model_and_tok
    ids = tok(make_document(tok, 1600, 5), return_tensors="pt")["input_ids"][:, :1500]
    calls = []
    for name in ("fetch_now", "refresh"):
        real = getattr(Pipeline, name)
        monkeypatch.setattr(Pipeline, name, lambda self, plan, real=real, name=name:
                            calls.append((name, plan.groups[0].group)) or real(self, plan))
    config = TierConfig(device_budget="8MB", host_budget="1GB")
    logits, counts, follow = {}, {}, None
    with torch.no_grad():
        for keep in (False, True):
            calls.clear()
            with TieredCache(model, config, "tierkv") as cache:
                out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
                follow = follow or [int(out.logits[0, -1].argmax())]
                steps = []
                for i in range(10):
                    if not keep:
                        cache._kept.clear()
                    token = torch.tensor([[follow[i]]])
                    steps.append(model(token, **cache_kwargs(model, cache), use_cache=True).logits[0, -1])
                    if not keep:
                        follow.append(int(steps[-1].argmax()))
                preselecting = {g for g, group in enumerate(cache.groups)
                                if cache.policy.preselects(cache, group[0])}
                assert cache._kept and set(cache._kept) <= preselecting
                assert all(isinstance(block, tierkv.scattered.Scattered)
                           for _, block in cache._kept.values())
            assert not cache._kept  # let go on close
            logits[keep], counts[keep] = torch.stack(steps), collections.Counter(n for n, _ in calls)
            assert {g for _, g in calls} <= preselecting
    assert counts[False]["refresh"] == 0 and counts[True]["refresh"] >= 10
    assert counts[True]["fetch_now"] + counts[True]["refresh"] == counts[False]["fetch_now"]
    assert torch.equal(logits[True], logits[False])


@pytest.mark.parametrize("policy, reads", [("tierkv", True), ("omnikv", True), ("full", False),
                                           ("quest", False), ("h2o", False)])
def test_only_policies_that_read_parts_are_delivered_them(model_and_tok, policy, reads):
    model, _ = model_and_tok
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), policy) as cache:
        assert cache.in_place is reads
