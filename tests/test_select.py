"""Leaf selection under a token budget (tierkv.select)."""
import pytest
import torch

from tierkv.config import ChunkConfig, SelectConfig
from tierkv.select import leaf_costs, select_by_bound, select_by_query, select_by_scores
from tierkv.tree import ChunkTree

KV, DIM = 3, 16


def random_tree(gen, n=2000, config=ChunkConfig(min=4, base=16, max=32)):
    """Leaves of random sizes over keys whose magnitude varies along the sequence."""
    period = torch.randint(20, 200, (1,), generator=gen)
    envelope = torch.exp(2 * torch.sin(torch.arange(n) / period))
    keys = torch.randn(KV, n, DIM, generator=gen) * envelope[None, :, None]
    tree = ChunkTree(config, KV, DIM)
    while tree.n < n:
        size = min(int(torch.randint(config.min, config.max + 1, (1,), generator=gen)), n - tree.n)
        tree.append_keys(keys[:, tree.n:tree.n + size].half(), tree.n)
    return tree


@pytest.mark.parametrize("seed", range(12))
def test_bound_pruned_search_selects_what_exhaustive_does(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen)
    saved = 0
    for case in range(40):
        group = int(torch.tensor([1, 3, 4])[torch.randint(0, 3, (1,), generator=gen)])
        query = torch.randn(KV * group, DIM, generator=gen) * 3
        top = 0.05 if case % 2 else 0.5
        config = SelectConfig(budget=float(torch.rand(1, generator=gen)) * top + 0.01,
                              sinks=int(torch.randint(0, 9, (1,), generator=gen)),
                              window=int(torch.randint(1, 200, (1,), generator=gen)))
        context = tree.n + int(torch.randint(0, 50, (1,), generator=gen))
        exact = select_by_bound(tree, query, config, context, prune=False)
        pruned = select_by_bound(tree, query, config, context, prune=True)
        assert torch.equal(exact.leaves, pruned.leaves)
        assert torch.equal(exact.tokens, pruned.tokens)
        if case % 2:
            saved += exact.evaluations - pruned.evaluations
    assert saved > 0  # at small budgets pruning skips subtrees on this data


def test_query_prefers_a_tight_hot_leaf_to_a_wide_one():
    # leaf 0's keys spread over [-10, 10]: its bound (10 * 2) is far above leaf 1's (2 * 2), but
    # its centre is 0, and attention reads leaf 1, whose every key scores 4
    tree = ChunkTree(ChunkConfig(min=1, base=8, max=64), 1, 2)
    wide = torch.linspace(-10, 10, 8)[None, :, None].expand(1, 8, 2)
    tree.append_keys(wide.contiguous(), 0)
    tree.append_keys(torch.full((1, 8, 2), 2.0), 1)
    config = SelectConfig(budget=9, sinks=0, window=1)  # the window token and one leaf
    sel = select_by_query(tree, torch.tensor([[1.0, 1.0]]), config, context=17, scale=1.0)
    assert sel.leaves.tolist() == [1] and sel.evaluations == 2


def expected_tokens(tree, leaves, context, config):
    mask = torch.zeros(context, dtype=torch.bool)
    mask[: config.sinks] = True
    mask[max(context - config.window, 0):] = True
    for i in leaves.tolist():
        mask[int(tree.bounds[i]):int(tree.bounds[i + 1])] = True
    return mask.nonzero().flatten()


@pytest.mark.parametrize("seed", range(10))
def test_selection_keeps_sinks_window_and_budget(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    tree = random_tree(gen, n=1500)
    for budget in (0.02, 0.1, 0.3, 64):
        config = SelectConfig(budget=budget, sinks=4, window=32)
        context = tree.n + 20
        scores = torch.rand(context, generator=gen) ** 20
        for sel in (select_by_scores(tree, scores, config),
                    select_by_query(tree, torch.randn(6, DIM, generator=gen), config, context)):
            assert torch.equal(sel.tokens, expected_tokens(tree, sel.leaves, context, config))
            free = min(context, config.sinks + config.window)
            assert sel.tokens.numel() <= max(config.tokens(context), free)
            assert bool((sel.leaves[1:] > sel.leaves[:-1]).all())


def test_leaf_costs_exclude_sinks_and_window():
    tree = ChunkTree(ChunkConfig(min=4, base=8, max=64), KV, DIM)
    for size in (10, 20, 30, 40):
        tree.append_keys(torch.randn(KV, size, DIM), tree.n)
    config = SelectConfig(sinks=4, window=45)
    assert leaf_costs(tree, 110, config).tolist() == [6, 20, 30, 5]
    with pytest.raises(ValueError, match="context"):
        leaf_costs(tree, 50, config)


def test_scores_rank_by_density():
    tree = ChunkTree(ChunkConfig(min=4, base=8, max=128), KV, DIM)
    for size in (8, 100, 8, 8):
        tree.append_keys(torch.randn(KV, size, DIM), tree.n)
    scores = torch.zeros(124 + 8)
    scores[8:108] = 0.004  # leaf 1: mass 0.4 over 100 tokens
    scores[108:116] = 0.02  # leaf 2: mass 0.16 over 8 tokens, denser
    config = SelectConfig(budget=12, sinks=0, window=1)
    assert select_by_scores(tree, scores, config).leaves.tolist() == [2]
    # leaf 1 costs more than the whole budget: it is skipped, not a stop
    assert select_by_scores(tree, scores, SelectConfig(budget=20, sinks=0, window=1)
                            ).leaves.tolist() == [0, 2]


def test_query_ranks_by_estimated_density():
    tree = ChunkTree(ChunkConfig(min=1, base=8, max=64), 1, 1)
    for value, size in ((2.0, 64), (1.9, 8)):
        tree.append_keys(torch.full((1, size, 1), value), tree.n)
    config = SelectConfig(budget=64, sinks=0, window=1)
    # scale 1: keys 2.0 - log(64) < 1.9 - log(8): the small leaf is denser and goes first,
    # after which the big one no longer fits
    sel = select_by_query(tree, torch.tensor([[1.0]]), config, context=73, scale=1.0)
    assert sel.leaves.tolist() == [1]


def test_query_ranks_by_centre_logit():
    tree = ChunkTree(ChunkConfig(min=1, base=8, max=64), 1, 2)
    for value in (1.0, 5.0, 3.0):
        tree.append_keys(torch.full((1, 8, 2), value), tree.n)
    config = SelectConfig(budget=16, sinks=0, window=1)
    sel = select_by_query(tree, torch.tensor([[1.0, 1.0]]), config, context=24)
    assert sel.leaves.tolist() == [1, 2] and sel.evaluations == 3


def test_a_token_budget_past_any_context_is_refused():
    """1e19 tokens overflowed torch's int64 in the selection (a traceback, or no answer)."""
    from tierkv.config import MAX_BUDGET_TOKENS

    assert SelectConfig(budget=MAX_BUDGET_TOKENS).tokens(100) == MAX_BUDGET_TOKENS
    with pytest.raises(ValueError, match=r"budget=1e\+19: a token count must be at most"):
        SelectConfig(budget=1e19)
