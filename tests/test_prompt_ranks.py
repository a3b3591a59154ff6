"""How a prompt's records rank for the host tier: by the attention of its last queries."""
from types import SimpleNamespace

import torch

from tierkv.hf.prefill import RANK_LEVELS, RANK_SPAN, prompt_ranks


def _cache(masses, record_tokens=4):
    return SimpleNamespace(groups=[[0], [1, 2]], record_tokens=[record_tokens, record_tokens],
                           prompt_mass=dict(enumerate(masses)))


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
