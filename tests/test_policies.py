"""Policy pieces that need no model: the honest budget, OmniKV's fill and its target group."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from tierkv import DeviceBudgetWarning, kernels
from tierkv.config import ChunkConfig, SelectConfig
from tierkv.hf.fetching import GroupFetches
from tierkv.hf.groups import GroupIndex
from tierkv.policies import Policy, make_policy
from tierkv.policies import tierkv as tierkv_policy
from tierkv.shapes import KVShape
from tierkv.tree import SplitRequest

KV, DIM = 2, 4
CHUNKS = ChunkConfig(min=4, base=8, max=64, desert_threshold=0.5, merge_after=1)


def index_over(tokens: int, record: int, seed: int = 0) -> tuple[GroupIndex, torch.Tensor]:
    """A group index over ``tokens`` sealed tokens in ``record``-token records, and its keys."""
    keys = torch.randn(KV, tokens, DIM, generator=torch.Generator().manual_seed(seed))
    index = GroupIndex("doc", 0, KV, DIM, CHUNKS)
    index.add([(s, s + record) for s in range(0, tokens, record)], keys)
    return index, keys


def omnikv(**select) -> Policy:
    return make_policy("omnikv", 6, SelectConfig(**{"filter_layers": (1,), **select}), CHUNKS, {})


def fetched_tokens(index: GroupIndex, leaves: torch.Tensor) -> torch.Tensor:
    return index.fetch(leaves).positions


def test_a_group_index_fetches_the_same_leaves_once_while_its_tree_stays():
    index, keys = index_over(64, 16)
    leaves = torch.tensor([0, 2])
    first = index.fetch(leaves)
    assert index.fetch(leaves.clone()) is first  # the same leaves, the same tree
    assert index.fetch(torch.tensor([0, 3])) is not first
    assert index.fetch(leaves) is not first  # asked after others: made anew, and alike
    again = index.fetch(leaves)
    assert again.keys == first.keys and torch.equal(again.positions, first.positions)
    index.tree.split(SplitRequest(16, 32, 24, 0.9), keys[:, 16:32])  # new leaves: 2 is 24-32
    split = index.fetch(leaves)
    assert split is not again and split.positions.tolist() == list(range(16)) + list(range(24, 32))
    index.add([(64, 66)], torch.randn(KV, 2, DIM))  # new records, a short last leaf
    tail = torch.tensor([index.tree.num_leaves - 1])
    assert index.fetch(leaves) is not split and index.fetch(tail).positions.tolist() == [64, 65]
    index.add([(66, 72)], torch.randn(KV, 6, DIM))  # the short leaf grows in place
    assert index.fetch(tail).positions.tolist() == list(range(64, 72))


def test_budget_of_a_group_counts_its_unsealed_tokens():
    policy = omnikv(budget=0.1, window=32)
    cache = SimpleNamespace(get_seq_length=lambda: 1000, indexes=[SimpleNamespace(sealed=960)],
                            shortest_window=lambda: 40)
    assert policy.budget(cache) == 100 - 32
    assert policy.budget(cache, 0) == 100 - 40
    cache.shortest_window = lambda: 20  # a crop left less: the budget covers what it left out
    assert policy.budget(cache) == 100 - 20


def test_omnikv_seals_base_chunks():
    assert omnikv().chunk_tokens == CHUNKS.base


def test_fill_takes_sinks_then_densest_chunks():
    index, _ = index_over(128, 8)
    scores = torch.full((160,), 1e-4)
    scores[44] = 1.0                  # one hot token in chunk 5
    scores[72:80] = 0.05              # a warm chunk 9, less mass per token than chunk 5
    scores[100:104] = 0.01            # chunk 12, colder still
    leaves = omnikv(sinks=4)._fill(index, scores, 24)
    assert leaves.tolist() == [0, 5, 9]
    assert fetched_tokens(index, leaves).numel() == 24


def test_fill_takes_split_leaves_and_the_fetch_keeps_their_tokens():
    index, keys = index_over(64, 16)
    index.tree.split(SplitRequest(16, 32, 24, 0.9), keys[:, 16:32])
    assert index.tree.sizes.tolist() == [16, 8, 8, 16, 16]
    scores = torch.zeros(64)
    scores[20] = 1.0                  # in the split leaf [16, 24), whose record is [16, 32)
    policy = omnikv(sinks=4)          # record units: the split leaf brings its whole record
    assert policy._fill(index, scores, 24).tolist() == [0]        # 16 + 16 does not fit 24
    leaves = policy._fill(index, scores, 32)
    assert leaves.tolist() == [0, 1, 2]
    assert index.fetch(leaves).positions.tolist() == list(range(32))
    leaves = omnikv(sinks=4, fetch_unit="leaf")._fill(index, scores, 24)
    assert leaves.tolist() == [0, 1]
    spec = index.fetch(leaves)
    assert [(k.start, k.end) for k in spec.keys] == [(0, 16), (16, 32)] and spec.tokens == 32
    assert spec.positions.tolist() == list(range(24)) and spec.keep.tolist() == list(range(24))


def test_fetch_keeps_the_chosen_leaves_of_shared_records():
    index, keys = index_over(64, 16)
    for start in (48, 32, 16):        # split [16, 32), [32, 48) and [48, 64) at their middles
        index.tree.split(SplitRequest(start, start + 16, start + 8, 0.9), keys[:, start:start + 16])
    assert index.tree.sizes.tolist() == [16, 8, 8, 8, 8, 8, 8]
    spec = index.fetch(torch.tensor([2, 3, 6]))  # [24, 32), [32, 40), [56, 64)
    assert [(k.start, k.end) for k in spec.keys] == [(16, 32), (32, 48), (48, 64)]
    assert spec.positions.tolist() == [*range(24, 40), *range(56, 64)]
    assert spec.keep.tolist() == [*range(8, 24), *range(40, 48)] and spec.tokens == 48
    whole = index.fetch(torch.tensor([0, 1, 2]))
    assert whole.keep is None and whole.positions.tolist() == list(range(32))
    twice = index.fetch(torch.tensor([1, 1]))  # as many tokens as record [16, 32), half of it
    assert twice.positions.tolist() == list(range(16, 24)) and twice.keep.tolist() == list(range(8))
    assert index.fetch(torch.zeros(0, dtype=torch.long)).keys == ()


def test_fill_counts_merged_leaves_whole_and_fills_past_them():
    index, _ = index_over(96, 8)
    tree, attention = index.tree, torch.ones(96)
    attention[32:64] = 0              # leaves 4..7 go cold and merge into one 32-token leaf
    for _ in range(6):
        tree.update(tree.mass_per_leaf(attention), torch.zeros(len(index), dtype=torch.bool), max_size=32)
    assert tree.sizes.tolist() == [8, 8, 8, 8, 32, 8, 8, 8, 8]
    scores = torch.full((96,), 0.01)
    scores[32:64] = 0.1               # the merged leaf is the densest, but costs 32
    scores[80:88] = 0.05              # leaf 7
    leaves = omnikv(sinks=4)._fill(index, scores, 16)
    assert leaves.tolist() == [0, 7]  # the merged leaf does not fit; the next densest does
    leaves = omnikv(sinks=4)._fill(index, scores, 48)
    assert leaves.tolist() == [0, 4, 7]


@pytest.mark.parametrize("unit", ["record", "leaf"])
@pytest.mark.parametrize("seed", range(20))
def test_fill_never_exceeds_the_budget(seed, unit):
    gen = torch.Generator().manual_seed(seed)
    index, keys = index_over(256, 8, seed)
    for leaf in torch.randperm(10, generator=gen)[:3].tolist():
        start, end = int(index.tree.bounds[leaf]), int(index.tree.bounds[leaf + 1])
        if end - start >= 2 * CHUNKS.min:
            index.tree.split(SplitRequest(start, end, start + 4, 0.9), keys[:, start:end])
    scores = torch.rand(256, generator=gen) ** 8
    budget = int(torch.randint(8, 120, (1,), generator=gen))
    tokens = fetched_tokens(index, omnikv(sinks=4, fetch_unit=unit)._fill(index, scores, budget))
    assert tokens.numel() <= budget
    assert tokens[:4].tolist() == [0, 1, 2, 3]


@pytest.mark.skipif(kernels.fill_units is None, reason="tierkv._native not built")
@pytest.mark.parametrize("seed", range(40))
def test_native_fill_chooses_the_leaves_torchs_path_does(seed, monkeypatch):
    """``kernels.fill_units`` and torch's path agree leaf for leaf over record units: split and
    merged leaves, sinks, ties in density, budgets below the sinks' units and past everything."""
    gen = torch.Generator().manual_seed(seed)
    index, keys = index_over(512, 16, seed)
    tree = index.tree
    for leaf in torch.randperm(30, generator=gen)[:6].tolist():  # split leaves share records
        start, end = int(tree.bounds[leaf]), int(tree.bounds[leaf + 1])
        if end - start < 2 * CHUNKS.min:
            continue
        cut = start + int(torch.randint(CHUNKS.min, end - start - CHUNKS.min + 1, (1,), generator=gen))
        tree.split(SplitRequest(start, end, cut, 0.5), keys[:, start:end])
    cold = torch.rand(512, generator=gen) < 0.5  # cold runs merge across records
    tree.update(tree.mass_per_leaf((~cold).float()), torch.zeros(len(index), dtype=torch.bool), max_size=48)
    scores = torch.rand(530, generator=gen) ** 8
    if seed % 3 == 0:
        scores = (scores * 4).round() / 4  # many equal densities
    policy = omnikv(sinks=int(torch.randint(0, 40, (1,), generator=gen)))
    for budget in (0, 10, 64, 200, 600):
        native = policy._fill(index, scores, budget)
        monkeypatch.setattr(kernels, "fill_units", None)
        assert torch.equal(native, policy._fill(index, scores, budget)), budget
        monkeypatch.undo()


@pytest.mark.skipif(kernels.fill_units is None, reason="tierkv._native not built")
def test_native_fill_refuses_sizes_that_do_not_nest():
    out = torch.empty(4, dtype=torch.long)
    scores, cuts = torch.ones(8), torch.tensor([0, 8])
    bounds = torch.tensor([0, 2, 4, 6, 8])
    with pytest.raises(ValueError, match="2 units over 1 leaves"):
        kernels.fill_units(scores.data_ptr(), 8, cuts.data_ptr(), 2, bounds.data_ptr(), 1, 0, 4,
                           out.data_ptr())
    assert kernels.fill_units(scores.data_ptr(), 8, cuts.data_ptr(), 1, bounds.data_ptr(), 4, 0,
                              8, out.data_ptr()) == 4


def test_target_skips_the_layer_that_attends_fully():
    for full_after, target in ((False, (2, 3, 4, 5)), (True, (3, 4, 5))):
        policy = omnikv(full_after_filter=full_after)
        groups = policy.groups()
        group_of = {layer: g for g, group in enumerate(groups) for layer in group}
        cache = SimpleNamespace(groups=groups, group_of=group_of)
        assert groups[policy._target(cache, 1)] == target


def test_record_sizes_follow_what_reads_each_group():
    # filter layers (1, 3) of 6: layer 0 is always dense, 1 and 3 filter, 2 and 4-5 select
    policy = make_policy("omnikv", 6, SelectConfig(filter_layers=(1, 3)), ChunkConfig(), {})
    sizes = {group: policy.record_tokens(group) for group in policy.groups()}
    assert sizes == {(0,): 128, (1,): 32, (2,): 8, (3,): 32, (4, 5): 8}
    after = make_policy("omnikv", 6, SelectConfig(filter_layers=(1, 3), full_after_filter=True),
                        ChunkConfig(), {})
    assert after.record_tokens((2,)) == 128  # the dense layer right after a filter layer
    small = make_policy("omnikv", 6, SelectConfig(filter_layers=(1, 3)),
                        ChunkConfig(min=4, base=8, max=16), {})
    assert small.record_tokens((0,)) == 16 and small.record_tokens((1,)) == 16  # capped at max


@pytest.mark.parametrize("chunks", [ChunkConfig(min=2, base=4, max=4),
                                    ChunkConfig(min=16, base=16, max=64)])
def test_a_policy_whose_chunks_the_config_forbids_is_refused_when_made(chunks):
    """``quest``'s 8-token pages outside ChunkConfig's leaf sizes: refused when the policy is
    made, naming both, not by the chunk tree in the middle of a prefill."""
    with pytest.raises(ValueError, match=r"policy 'quest' seals 8-token chunks \(layer 0\), "
                                         rf"outside ChunkConfig\(min={chunks.min}, max={chunks.max}\)"):
        make_policy("quest", 6, SelectConfig(), chunks, {})
    for name in ("full", "omnikv", "tierkv", "leoam", "streaming", "h2o"):  # follow ``base``
        make_policy(name, 6, SelectConfig(filter_layers=(1, 3)), chunks, {})


def leaves_read_by_one_head() -> tuple[GroupIndex, torch.Tensor]:
    """8 leaves of 8 tokens: kv head 1 reads leaf 3 (keys along the query), leaf 6 is wide in
    both heads (the largest bound, its box centred on 0); and the query, shape (2, DIM)."""
    keys = 0.1 * torch.randn(KV, 64, DIM, generator=torch.Generator().manual_seed(3))
    keys[1, 24:32, 0] = 3.0
    keys[:, 48:56:2, 0], keys[:, 49:56:2, 0] = 20.0, -20.0
    index = GroupIndex("doc", 0, KV, DIM, CHUNKS)
    index.add([(s, s + 8) for s in range(0, 64, 8)], keys)
    q = torch.zeros(KV, DIM)
    q[:, 0] = 1.0
    return index, q


def test_share_scores_rank_what_a_head_reads_over_wide_leaves():
    index, q = leaves_read_by_one_head()
    assert int(index.bound_scores(q).argmax()) == 6
    assert int(index.share_scores(q).argmax()) == 3


@pytest.mark.parametrize("name", ["quest", "leoam"])
def test_quest_and_leoam_fetch_by_estimated_shares(name):
    index, q = leaves_read_by_one_head()
    policy = make_policy(name, 6, SelectConfig(budget=24, window=8, sinks=4), CHUNKS, {})
    cache = SimpleNamespace(get_seq_length=lambda: 72, index_of=lambda layer: index,
                            group_of=list(range(6)), fit_to_device=lambda group, tokens: tokens,
                            shortest_window=lambda: 8)
    assert policy.fetch(cache, 4, q[:, None]).tolist() == [0, 3]  # the sink page, then leaf 3


def test_fetch_unit_is_checked():
    with pytest.raises(ValueError, match="fetch_unit='token'"):
        SelectConfig(fetch_unit="token")


def test_leaf_units_seal_selecting_groups_as_smallest_leaves():
    policy = omnikv(fetch_unit="leaf")            # filter layer 1 of 6: (0,) dense, (1,) filter
    assert [policy.leaf_tokens(g) for g in policy.groups()] == [None, None] + [CHUNKS.min] * (
        len(policy.groups()) - 2)
    assert all(omnikv().leaf_tokens(g) is None for g in omnikv().groups())
    keys = torch.randn(KV, 24, DIM)
    index = GroupIndex("doc", 0, KV, DIM, CHUNKS)
    index.add([(0, 8), (8, 16), (16, 24)], keys, CHUNKS.min)
    assert index.tree.bounds.tolist() == [0, 4, 8, 12, 16, 20, 24]
    assert [(k.start, k.end) for k in index.keys] == [(0, 8), (8, 16), (16, 24)]
    spec = index.fetch(torch.tensor([1, 4]))
    assert spec.positions.tolist() == [*range(4, 8), *range(16, 20)] and spec.tokens == 16


def test_leaf_fill_keeps_the_records_it_moves_within_the_move_factor():
    from tierkv.policies.omnikv import LEAF_MOVE_FACTOR

    keys = torch.randn(KV, 64, DIM)
    index = GroupIndex("doc", 0, KV, DIM, CHUNKS)
    index.add([(s, s + 8) for s in range(0, 64, 8)], keys, CHUNKS.min)  # two 4-token leaves each
    scores = torch.zeros(64)
    for i, record in enumerate(range(1, 8)):   # a hot token in the first leaf of records 1..7
        scores[8 * record] = 1.0 - 0.1 * i
    budget = 20
    assert LEAF_MOVE_FACTOR * budget < 32      # the fourth record would pass the limit
    leaves = omnikv(sinks=4, fetch_unit="leaf")._fill(index, scores, budget)
    # sinks' leaf, the hot leaves of records 1 and 2, then leaves of records already brought
    assert leaves.tolist() == [0, 1, 2, 3, 4]
    spec = index.fetch(leaves)
    assert spec.tokens == 24 and spec.positions.tolist() == list(range(20))
    # a device tier that holds 16 of the group's tokens: two records, all of their leaves
    leaves = omnikv(sinks=4, fetch_unit="leaf")._fill(index, scores, budget, moved=16)
    assert leaves.tolist() == [0, 1, 2, 3] and index.fetch(leaves).tokens == 16


def preselecting_cache(index, device: int):
    """A stand-in for a TieredCache of 6 layers in groups (0,), (1,) (the filter layer) and
    (2, 3, 4, 5), 8-token records, 1040 tokens of context, ``device`` bytes of device tier."""
    cache = StandIn()
    cache.__dict__.update(
        store=SimpleNamespace(device=SimpleNamespace(budget=device)), groups=[(0,), (1,), (2, 3, 4, 5)],
        group_bytes=lambda layer: 1 << 20, index_of=lambda layer: index,
        get_seq_length=lambda: 1040, shortest_window=lambda: 32, shape=KVShape(6, KV, DIM),
        group_of=[0, 1, 2, 2, 2, 2],
        indexes=[index] * 3, spare_tokens=lambda g: 32 + 8,  # window + record tokens
        fetch_ahead=True, policy=SimpleNamespace(name="tierkv"), trimmed_fetches=0,
        trimmed_tokens=0, _window=SimpleNamespace(most_bytes=lambda extra=0: 6 * (40 + extra) * 64))
    return cache


class StandIn(GroupFetches):
    """What of a TieredCache a test sets, with its fetches' room (``fetch_room``, ...)."""


def preselected_tokens(budget: float, device: int, fetch_unit: str = "record") -> int:
    index, _ = index_over(1024, 8)
    select = SelectConfig(budget=budget, filter_layers=(1,), fetch_unit=fetch_unit)
    policy = make_policy("tierkv", 6, select, CHUNKS, {})
    q = torch.randn(2 * KV, 1, DIM, generator=torch.Generator().manual_seed(0))
    leaves = policy.preselect(preselecting_cache(index, device), 1, q)
    return int(index.tree.sizes[leaves].sum())


@pytest.mark.parametrize("budget, candidates", [(0.05, 409), (0.25, 4 * (260 - 32))])
def test_preselection_scores_at_least_its_floor_of_the_context(budget, candidates):
    """A filter layer's LKA preselection keeps PRESELECT_FACTOR x the budget, and never less
    than PRESELECT_FLOOR (0.4) of the sealed context, when the device tier has room for it."""
    tokens = preselected_tokens(budget, 3 << 20)
    assert candidates - CHUNKS.base < tokens <= candidates


@pytest.mark.parametrize("fetch_unit", ["record", "leaf"])
@pytest.mark.parametrize("room, candidates", [(200, 160), (80, 2 * 20), (60, 20)])
def test_preselection_stays_within_the_device_room(room, candidates, fetch_unit):
    """Candidates fit beside the windows, down to PRESELECT_MIN_FACTOR x the budget, and below
    it only as far as the device tier does not hold that (with a warning). At 5 % of 1040
    tokens the budget is 52 - 32 (window) = 20 tokens; the windows take 6 x (32 + 8) tokens, 64
    B a token and layer, and the fetch keeps room for its own window (40 tokens). The selecting
    groups' fetches need no room beside them (whatever the fetch unit): a filter layer's choice
    is fetched once its candidates are let go."""
    per_token = KVShape(6, KV, DIM).token_bytes(1)
    assert per_token == 64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = preselected_tokens(0.05, (6 * 40 + room) * per_token, fetch_unit)
    assert candidates - CHUNKS.base < tokens <= candidates
    trimmed = [w for w in caught if issubclass(w.category, DeviceBudgetWarning)]
    assert len(trimmed) == (candidates < 2 * 20)
    if trimmed:
        assert "holds 20 tokens of layer group 1 (layers 1) beside the recent windows, fewer " \
               "than the 40" in str(trimmed[0].message)


@pytest.mark.parametrize("device, narrowed", [(3 << 20, True), (4 << 20, False)])
def test_layers_before_the_first_filter_preselect_like_it(device, narrowed):
    """``tierkv`` narrows the layers before the first filter layer (read whole by ``omnikv``)
    by the same rule as the filter layers: once their group's KV (1 MiB here) outgrows a
    quarter of the device tier. They attend their candidates only, so they take the token
    budget, where a filter layer takes a wide margin for the layers after it, which keep
    reusing its choice."""
    index, _ = index_over(1024, 8)
    cache = preselecting_cache(index, device)
    select = SelectConfig(budget=0.25, filter_layers=(1,))
    q = torch.randn(2 * KV, 1, DIM, generator=torch.Generator().manual_seed(0))
    tierkv, plain = (make_policy(name, 6, select, CHUNKS, {}) for name in ("tierkv", "omnikv"))
    assert plain.fetch(cache, 0, q) is None and plain.dense(cache, 0)
    assert [tierkv.preselects(cache, layer) for layer in range(6)] == [narrowed] * 2 + [False] * 4
    assert tierkv.dense(cache, 0) is not narrowed
    leaves = tierkv.fetch(cache, 0, q)
    if narrowed:
        budget = tierkv.budget(cache)
        assert budget - CHUNKS.base < int(index.tree.sizes[leaves].sum()) <= budget
        filtered = tierkv.fetch(cache, 1, q)
        assert int(index.tree.sizes[filtered].sum()) > 2 * budget
    else:
        assert leaves is None


def test_preselected_candidates_are_announced_from_the_last_query(monkeypatch):
    """With ``fetch_ahead``, a preselecting layer's fetch is known ahead once it has had a query:
    the candidates that query ranks first. Its next fetch brings exactly those (they are on
    their way), whatever its new query, which ranks the step after; context sealed in between
    is ranked again. (Ranked by the query alone here: the leaves fetched last are not favoured.)"""
    monkeypatch.setattr(tierkv_policy, "PRESELECT_STICKINESS", 0.0)
    index, _ = index_over(1024, 8)
    cache = preselecting_cache(index, 3 << 20)
    select = SelectConfig(budget=0.05, filter_layers=(1,))
    policy, fresh = (make_policy("tierkv", 6, select, CHUNKS, {}) for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    q1, q2 = (torch.randn(2 * KV, 1, DIM, generator=gen) for _ in range(2))
    assert policy.ahead(cache, 1) == (False, None)
    first = policy.fetch(cache, 1, q1)
    cache.fetch_ahead = False  # the cache's choice (a CPU's): the candidates wait for the query
    assert policy.ahead(cache, 1) == (False, None)
    cache.fetch_ahead = True
    known, wanted = policy.ahead(cache, 1)
    assert known and torch.equal(wanted, first)
    assert torch.equal(policy.fetch(cache, 1, q2), first)
    by_q2 = fresh.fetch(cache, 1, q2)
    assert not torch.equal(by_q2, first)  # the two queries rank apart
    assert torch.equal(policy.ahead(cache, 1)[1], by_q2)
    index.add([(1024, 1032)], torch.randn(KV, 8, DIM, generator=gen))
    known, wanted = policy.ahead(cache, 1)
    assert known and torch.equal(wanted, make_policy("tierkv", 6, select, CHUNKS, {})._candidates(
        cache, 1, q2[:, 0]))
    # layers that do not preselect: a dense layer's whole KV is known ahead, a selecting one's not
    assert make_policy("omnikv", 6, select, CHUNKS, {}).ahead(cache, 0) == (True, None)
    assert policy.ahead(cache, 2) == (False, None)


def test_preselected_candidates_change_little_from_step_to_step():
    """A preselecting layer ranks the leaves it fetched at its last step ``PRESELECT_STICKINESS``
    x the leaves higher: a query close to the last one keeps more of the candidates (fewer come
    from disk) than ranking by it alone would, and a query that ranks the leaves anew still
    changes them."""
    index, _ = index_over(1024, 8)
    cache = preselecting_cache(index, 3 << 20)
    cache.fetch_ahead = False
    select = SelectConfig(budget=0.05, filter_layers=(1,))
    gen = torch.Generator().manual_seed(2)
    q1 = torch.randn(2 * KV, 1, DIM, generator=gen)
    near = q1 + 0.7 * torch.randn(2 * KV, 1, DIM, generator=gen)
    for q2, kept_at_least in ((near, 0.75), (-q1, 0.0)):
        sticky, fresh = (make_policy("tierkv", 6, select, CHUNKS, {}) for _ in range(2))
        first = set(sticky.fetch(cache, 1, q1).tolist())
        by_query = set(fresh.fetch(cache, 1, q2).tolist())
        second = set(sticky.fetch(cache, 1, q2).tolist())
        assert len(second & first) >= max(len(by_query & first), kept_at_least * len(first))
        assert second != first
        if kept_at_least:
            assert len(second & first) > len(by_query & first)
    assert tierkv_policy.PRESELECT_STICKINESS > 0


@pytest.mark.parametrize("name", ["omnikv", "tierkv"])
@pytest.mark.parametrize("filters, layer", [((2, 50), 50), ((2, 29), 29)])
def test_filter_layers_at_or_past_the_last_layer_are_refused(name, filters, layer):
    """Not dropped: the layers they were to serve would silently follow another filter."""
    with pytest.raises(ValueError, match=rf"filter_layers=\(2, {layer}\): layer {layer} is at or past "
                                         r"the model's last layer 29; filter layers must be strictly "
                                         r"increasing layer indices in \[0, 29\)"):
        make_policy(name, 30, SelectConfig(filter_layers=filters), CHUNKS, {})
    assert make_policy(name, 30, SelectConfig(filter_layers=(2, 28)), CHUNKS, {}).filters == (2, 28)


@pytest.mark.parametrize("filters", [[12, 2, 17], [2, 2, 17], [-3, 2, 17], [17, 2], [2.0], "2,8",
                                     None, [], [2, 29]])
def test_profile_filter_layers_are_checked_by_the_policy(filters):
    with pytest.raises(ValueError, match=r"profile filter_layers=.*: (layer 29 is at or past the model's "
                                         r"last layer 29; filter layers )?must be strictly increasing "
                                         r"layer indices in \[0, 29\)"):
        make_policy("tierkv", 30, SelectConfig(), CHUNKS, {"filter_layers": filters})
    profile = {"filter_layers": [2, 12, 17]}
    assert make_policy("omnikv", 30, SelectConfig(), CHUNKS, profile).filters == (2, 12, 17)


def test_default_filters_fit_a_shallow_model():
    """The defaults serve deep models: a shallow one keeps those below its last layer, and one
    with none is named."""
    assert make_policy("omnikv", 4, SelectConfig(), CHUNKS, {}).filters == (2,)
    assert make_policy("omnikv", 30, SelectConfig(), CHUNKS, {}).filters == (2, 8, 16)
    with pytest.raises(ValueError, match="policy 'omnikv' needs a filter layer below the last layer 2"):
        make_policy("omnikv", 3, SelectConfig(), CHUNKS, {})


@pytest.mark.parametrize("heads, match", [
    ([[14, 1]], r"retrieval_heads=\[\[14, 1\]\]: expected a dict"),
    ({"x": [1]}, r"retrieval_heads\['x'\]: the key must be a layer index"),
    ({"30": [1]}, r"retrieval_heads\['30'\]: layer out of range \[0, 30\)"),
    ({"14": 1}, r"retrieval_heads\['14'\]=1: expected a list of KV head indices"),
    ({"14": [-1]}, r"retrieval_heads\['14'\]=\[-1\]: expected a list of KV head indices"),
])
def test_razor_names_bad_retrieval_heads(heads, match):
    with pytest.raises(ValueError, match=match):
        make_policy("razor", 30, SelectConfig(), CHUNKS, {"retrieval_heads": heads})
    policy = make_policy("razor", 30, SelectConfig(), CHUNKS, {"retrieval_heads": {"14": [1], 3: [0, 2]}})
    assert policy.retrieval == {14: [1], 3: [0, 2]}


@pytest.mark.parametrize("shuffled", [False, True])
def test_adapt_splits_the_leaves_whose_keys_are_all_at_hand(shuffled):
    """A fold splits a leaf whose attention sits in one half when every one of its tokens is
    among the keys at hand (in any order), from those keys; a leaf missing a token is not
    split."""
    index, keys = index_over(64, 8)
    scores = torch.zeros(64)
    scores[16:20] = scores[40:44] = 1.0  # the first halves of leaves [16, 24) and [40, 48)
    positions = torch.cat([torch.arange(16, 24), torch.arange(40, 47)])  # 47 was not fetched
    if shuffled:
        positions = positions[torch.randperm(positions.numel(), generator=torch.Generator().manual_seed(1))]
    at_hand = keys[:, positions]
    index.adapt(scores, torch.arange(len(index)), 0, lambda i: at_hand[:, i], positions, 64)
    bounds = index.tree.bounds.tolist()
    assert 20 in bounds and 44 not in bounds and 40 in bounds
    leaf = bounds.index(16)
    assert torch.equal(index.tree.kmin[leaf], keys[:, 16:20].amin(dim=1))
    assert torch.equal(index.tree.kmax[leaf + 1], keys[:, 20:24].amax(dim=1))
    index.tree.validate()


def test_adapt_refuses_positions_that_name_a_token_twice():
    index, keys = index_over(64, 8)
    scores = torch.zeros(64)
    scores[16:20] = 1.0
    positions = torch.tensor([17, 16, 18, 19, 20, 21, 22, 23, 17])
    with pytest.raises(ValueError, match="name a token twice"):
        index.adapt(scores, torch.arange(len(index)), 0, lambda i: keys[:, positions][:, i],
                    positions, 64)
