"""How a prompt's records rank for the host tier: by the attention of its last queries."""
from types import SimpleNamespace

import torch

from tierkv.hf.prefill import RANK_LEVELS, RANK_SPAN, prompt_ranks
from tierkv.storage.base import RecordKey


class _Guess:
    """A policy whose ``prompt_candidates`` names ``leaves`` for ``layer`` (None otherwise)."""

    def __init__(self, layer=None, leaves=None):
        self.layer, self.leaves, self.asked = layer, leaves, []

    def prompt_candidates(self, cache, layer, query):
        self.asked.append((layer, query))
        return self.leaves if layer == self.layer else None


class _Index:
    """Leaf i is the 4-token record at 4 * i."""

    def fetch(self, leaves):
        return SimpleNamespace(keys=[RecordKey("d", 1, 4 * i, 4 * i + 4) for i in leaves.tolist()])


def _cache(masses, record_tokens=4, policy=None, queries=None):
    return SimpleNamespace(groups=[[0], [1, 2]], record_tokens=[record_tokens, record_tokens],
                           prompt_mass=dict(enumerate(masses)), prompt_query=dict(queries or {}),
                           policy=policy or _Guess(), indexes=[None, _Index()])


def test_records_rank_by_the_mass_their_group_was_paid_above_hot_and_below_a_read():
    # group 1 (layers 1 and 2): 3 records of 4 tokens from position 4; layer 2 decides the order
    masses = [torch.zeros(16), torch.ones(16), torch.zeros(16)]
    masses[2][4:8], masses[2][8:12], masses[2][12:16] = 0.5, 3.0, 0.25
    cache = _cache(masses)
    ranks = prompt_ranks(cache, 1, 4, 3, hot=7.0, ranked=True)
    assert sorted(ranks, reverse=True) == [ranks[1], ranks[0], ranks[2]]
    assert all(7.0 < r <= 7.0 + RANK_SPAN for r in ranks) and ranks[1] == 7.0 + RANK_SPAN
    assert 1 not in cache.prompt_mass and 2 not in cache.prompt_mass  # used once
    assert 0 in cache.prompt_mass                                     # another group's


def test_ranks_come_in_levels():
    mass = torch.arange(400, dtype=torch.float32)
    ranks = prompt_ranks(_cache([mass], record_tokens=1), 0, 0, 400, hot=0.0, ranked=True)
    assert len(set(ranks)) == RANK_LEVELS and ranks == sorted(ranks)


def test_without_the_mass_of_every_layer_or_when_not_ranked_all_rank_hot():
    masses = [torch.ones(16), torch.ones(16)]  # layer 2's is missing (a decode step's seal)
    assert prompt_ranks(_cache(masses), 1, 4, 3, hot=2.0, ranked=True) == [2.0] * 3
    cache = _cache([torch.ones(16)] * 3)
    assert prompt_ranks(cache, 1, 4, 3, hot=2.0 ** 60, ranked=False) == [2.0 ** 60] * 3
    assert 1 not in cache.prompt_mass  # let go all the same
    short = _cache([torch.ones(10)] * 3)  # does not cover the records: not this prompt's
    assert prompt_ranks(short, 1, 4, 3, hot=1.0, ranked=True) == [1.0] * 3


def test_the_records_a_preselecting_layer_would_fetch_rank_at_the_top():
    # group 1: records at 4, 8, 12 paid 3.0, 0.5, 0.25; layer 1 (the group's first) would fetch
    # leaves 0, 3 and 4: records 0 (sealed before: left alone) and 12, and 16 (not sealed yet)
    masses = [torch.zeros(16), torch.zeros(16), torch.zeros(16)]
    masses[1][4:8], masses[1][8:12], masses[1][12:16] = 3.0, 0.5, 0.25
    query = torch.ones(9, 64)
    policy = _Guess(layer=1, leaves=torch.tensor([0, 3, 4]))
    cache = _cache(masses, policy=policy, queries={1: query, 2: 2 * query, 0: query})
    ranks = prompt_ranks(cache, 1, 4, 3, hot=1.0, ranked=True)
    assert ranks[0] == ranks[2] == 1.0 + RANK_SPAN and ranks[1] < ranks[0]
    assert [layer for layer, _ in policy.asked] == [1] and policy.asked[0][1] is query
    assert set(cache.prompt_query) == {0}  # the group's queries are let go; another group's kept
    no_guess = _cache(masses, policy=_Guess(layer=1, leaves=None), queries={1: query})
    assert prompt_ranks(no_guess, 1, 4, 3, hot=1.0, ranked=True)[2] < 1.0 + RANK_SPAN / 2


def test_without_the_prompts_last_query_no_guess_is_asked_for():
    masses = [torch.ones(16)] * 3
    policy = _Guess(layer=1, leaves=torch.tensor([1]))
    prompt_ranks(_cache(masses, policy=policy), 1, 4, 3, hot=1.0, ranked=True)
    assert policy.asked == []
