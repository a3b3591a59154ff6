"""The adaptive chunk tree (tierkv.tree): tiling, merge / split, payload records."""
import copy

import pytest
import torch

from tierkv.config import ChunkConfig, SelectConfig
from tierkv.select import adaptation_scores, select_by_scores
from tierkv.summary import summarize, summarize_segments
from tierkv.records import RecordRef
from tierkv.tree import ChunkTree, SplitRequest

SMALL = ChunkConfig(min=4, base=8, max=32, desert_threshold=0.3, merge_after=2,
                    split_concentration=0.7)
KV, DIM = 2, 8


class FakeStore:
    """Payload records in a dict, rewritten the way the storage would when idle."""

    def __init__(self):
        self.records, self.next = {}, 0

    def put(self, payload):
        self.next += 1
        self.records[self.next] = payload.clone()
        return self.next

    def rewrite_all(self, tree, gen):
        for rw in tree.pending_rewrites():
            if torch.rand(1, generator=gen) < 0.5:
                data = torch.cat([self.records.pop(r.handle) for r in rw.old], dim=1)
                base = rw.cuts[0]
                tree.commit_rewrite(rw, [self.put(data[:, a - base:b - base])
                                         for a, b in zip(rw.cuts, rw.cuts[1:])])

    def leaf_payload(self, tree, i):
        refs = tree.records_for(torch.tensor([i]))
        data = torch.cat([self.records[r.handle] for r in refs], dim=1)
        start, end = int(tree.bounds[i]), int(tree.bounds[i + 1])
        return data[:, start - refs[0].start:end - refs[0].start]


def spiky_scores(gen, n, hot):
    """Attention-like scores: a little noise, most mass on a few hot tokens that persist."""
    scores = torch.rand(n, generator=gen) ** 12
    scores[hot[hot < n]] += 5.0
    return scores / scores.sum()


def check(tree, store, keys, every_leaf):
    tree.validate()
    if tree.n == 0:
        return
    lo, hi = summarize_segments(keys[:, :tree.n], tree.bounds)
    assert torch.equal(tree.kmin, lo) and torch.equal(tree.kmax, hi)
    assert tree.record_cuts.tolist() == [r.start for r in tree.records] + [tree.n]  # not stale
    stored = torch.cat([store.records[r.handle] for r in tree.records], dim=1)
    assert torch.equal(stored, keys[:, :tree.n])
    for i in range(tree.num_leaves) if every_leaf else ():
        start, end = int(tree.bounds[i]), int(tree.bounds[i + 1])
        assert torch.equal(store.leaf_payload(tree, i), keys[:, start:end])


def evaluate(tree, keys, gen, select, hot):
    scores = spiky_scores(gen, tree.n + 3, hot)
    chosen = select_by_scores(tree, scores, select).leaves
    mask = torch.zeros(tree.num_leaves, dtype=torch.bool)
    mask[chosen] = True
    scores = adaptation_scores(scores, select)
    changes = tree.update(tree.mass_per_leaf(scores), mask, scores)
    tree.split_many(changes.splits, [keys[:, r.start:r.end] for r in changes.splits])
    return changes


@pytest.mark.parametrize("seed", range(25))
def test_random_operations_keep_tiling_summaries_and_payloads(seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV, 400, DIM, generator=gen).half()
    tree, store = ChunkTree(SMALL, KV, DIM), FakeStore()
    select = SelectConfig(budget=0.25, sinks=2, window=4)
    merges = splits = 0
    hot = torch.randint(0, keys.shape[1], (4,), generator=gen)
    for step in range(80):
        op = int(torch.randint(0, 4, (1,), generator=gen))
        if op == 0 or tree.n < 40:
            size = SMALL.base if torch.rand(1, generator=gen) < 0.8 else 3
            if tree.n + size <= keys.shape[1]:
                end = tree.n + size
                tree.append_keys(keys[:, tree.n:end], store.put(keys[:, tree.n:end]))
        elif op == 1:
            store.rewrite_all(tree, gen)
        else:
            if op == 3:  # attention moves: one hot token jumps elsewhere
                hot[int(torch.randint(0, 4, (1,), generator=gen))] = int(
                    torch.randint(0, tree.n, (1,), generator=gen))
            changes = evaluate(tree, keys, gen, select, hot)
            merges, splits = merges + len(changes.merged), splits + len(changes.splits)
        check(tree, store, keys, every_leaf=step % 8 == 7)
    assert merges > 0 and splits > 0


def reference_split(tree, request, keys):
    """One split the plain way (each array rebuilt around the leaf): what split_many must do."""
    i = int(torch.searchsorted(tree.bounds, request.start, right=True)) - 1
    cut = request.cut - request.start
    lo_a, hi_a = summarize(keys[:, :cut])
    lo_b, hi_b = summarize(keys[:, cut:])
    share = torch.tensor([request.first_share, 1 - request.first_share])
    tree.bounds = torch.cat([tree.bounds[:i + 1], torch.tensor([request.cut]), tree.bounds[i + 1:]])
    tree.kmin = torch.cat([tree.kmin[:i], torch.stack([lo_a, lo_b]), tree.kmin[i + 1:]])
    tree.kmax = torch.cat([tree.kmax[:i], torch.stack([hi_a, hi_b]), tree.kmax[i + 1:]])
    tree.ema = torch.cat([tree.ema[:i], tree.ema[i] * share, tree.ema[i + 1:]])
    count = tree.selected_count[i:i + 1]
    tree.selected_count = torch.cat([tree.selected_count[:i], count, tree.selected_count[i:]])
    tree.cold = torch.cat([tree.cold[:i], tree.cold.new_zeros(2), tree.cold[i + 1:]])


@pytest.mark.parametrize("seed", range(5))
def test_split_many_is_the_splits_one_by_one(seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV, 256, DIM, generator=gen)
    tree = ChunkTree(SMALL, KV, DIM)
    for start in range(0, 256, 16):
        tree.append_keys(keys[:, start:start + 16], start)
    m = tree.num_leaves  # statistics that differ from leaf to leaf
    tree.ema = torch.rand(m, generator=gen)
    tree.selected_count = torch.randint(0, 9, (m,), generator=gen)
    tree.cold = torch.randint(1, 3, (m,), generator=gen)
    leaves = torch.randperm(tree.num_leaves, generator=gen)[:7].tolist()  # in no order
    cuts = torch.randint(4, 13, (7,), generator=gen).tolist()
    requests = [SplitRequest(16 * i, 16 * i + 16, 16 * i + c, float(torch.rand(1, generator=gen)))
                for i, c in zip(leaves, cuts)]
    expected = copy.deepcopy(tree)
    for r in requests:
        reference_split(expected, r, keys[:, r.start:r.end])
    tree.split_many(requests, [keys[:, r.start:r.end] for r in requests])
    tree.validate()
    for name in ("bounds", "kmin", "kmax", "ema", "selected_count", "cold"):
        assert torch.equal(getattr(tree, name), getattr(expected, name)), name


def test_split_many_refuses_a_bad_request_and_changes_nothing():
    keys = torch.randn(KV, 32, DIM)
    tree = ChunkTree(SMALL, KV, DIM)
    tree.append_keys(keys[:, :16], "a")
    tree.append_keys(keys[:, 16:], "b")
    before = copy.deepcopy(tree)
    good = SplitRequest(0, 16, 8, 0.5)
    refused = [([good, good], [keys[:, :16]] * 2, "leaf 0 more than once"),
               ([good, SplitRequest(16, 32, 20, 0.5)], [keys[:, :16]], "2 split requests with 1 key"),
               ([good, SplitRequest(0, 8, 4, 0.5)], [keys[:, :16], keys[:, :8]], "does not match"),
               ([good, SplitRequest(16, 32, 16, 0.5)], [keys[:, :16], keys[:, 16:]], "does not match"),
               ([good, SplitRequest(16, 32, 32, 0.5)], [keys[:, :16], keys[:, 16:]], "does not match"),
               ([good, SplitRequest(16, 32, 20, 0.5)], [keys[:, :16], keys[:, 16:24]], "keys")]
    for requests, tensors, message in refused:
        with pytest.raises(ValueError, match=message):
            tree.split_many(requests, tensors)
        for name in ("bounds", "kmin", "kmax", "ema", "selected_count", "cold"):
            assert torch.equal(getattr(tree, name), getattr(before, name)), (message, name)
    tree.split_many([], [])
    assert tree.bounds.tolist() == [0, 16, 32]


def test_split_then_merge_restores_parent_summary():
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(KV, 64, DIM, generator=gen).to(torch.bfloat16)
    tree = ChunkTree(SMALL, KV, DIM)
    for start in range(0, 64, 16):
        tree.append_keys(keys[:, start:start + 16], start)
    parent = tree.kmin[1].clone(), tree.kmax[1].clone()
    tree.split(SplitRequest(16, 32, 24, 0.9), keys[:, 16:32])
    assert tree.bounds.tolist() == [0, 16, 24, 32, 48, 64]
    mass = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    for _ in range(20):
        changes = tree.update(mass, torch.zeros(tree.num_leaves, dtype=torch.bool))
        if changes.merged:
            break
    assert changes.merged == [(16, 32)] and tree.num_leaves == 4
    assert torch.equal(tree.kmin[1], parent[0]) and torch.equal(tree.kmax[1], parent[1])


def test_split_request_from_concentrated_mass():
    tree = ChunkTree(SMALL, KV, DIM)
    keys = torch.randn(KV, 32, DIM)
    tree.append_keys(keys[:, :16], "a")
    tree.append_keys(keys[:, 16:], "b")
    scores = torch.zeros(32)
    scores[18] = 1.0
    changes = tree.update(tree.mass_per_leaf(scores), torch.tensor([False, True]), scores)
    assert changes.splits == [SplitRequest(16, 32, 24, 1.0)]
    with pytest.raises(ValueError, match="keys"):
        tree.split(changes.splits[0], keys[:, :8])


def test_mass_per_leaf_is_a_segment_sum():
    tree = ChunkTree(SMALL, KV, DIM)
    for start, size in [(0, 8), (8, 8), (16, 5)]:
        tree.append_keys(torch.randn(KV, size, DIM), start)
    scores = torch.arange(30, dtype=torch.float32)
    assert tree.mass_per_leaf(scores).tolist() == [sum(range(0, 8)), sum(range(8, 16)),
                                                   sum(range(16, 21))]


def test_short_tail_grows_and_limits_are_checked():
    tree = ChunkTree(ChunkConfig(min=4, base=8, max=8), KV, DIM)
    tree.append_keys(torch.randn(KV, 2, DIM), "a")
    tree.append_keys(torch.randn(KV, 5, DIM), "b")  # joins the 2-token tail
    assert tree.bounds.tolist() == [0, 7] and len(tree.records) == 2
    assert len(tree.pending_rewrites()) == 1
    with pytest.raises(ValueError, match="start at n=7"):
        tree.append(0, 4, torch.zeros(KV, DIM), torch.zeros(KV, DIM), "c")
    with pytest.raises(ValueError, match="max"):
        tree.append_keys(torch.randn(KV, 9, DIM), "c")
    tree.append_keys(torch.randn(KV, 2, DIM), "c")  # a new short tail [7, 9)
    with pytest.raises(ValueError, match="short tail"):
        tree.append_keys(torch.randn(KV, 7, DIM), "d")
    assert len(tree.records) == 3 and tree.bounds.tolist() == [0, 7, 9]  # nothing changed
    with pytest.raises(ValueError, match="kmin"):
        tree.append(9, 11, torch.zeros(DIM), torch.zeros(DIM), "e")


def test_stale_rewrite_is_refused():
    tree = ChunkTree(SMALL, KV, DIM)
    tree.append_keys(torch.randn(KV, 2, DIM), "a")
    tree.append_keys(torch.randn(KV, 8, DIM), "b")
    rewrite = tree.pending_rewrites()[0]
    tree.commit_rewrite(rewrite, ["ab"])
    assert [r.handle for r in tree.records] == ["ab"]
    with pytest.raises(ValueError, match="stale"):
        tree.commit_rewrite(rewrite, ["ab2"])


def test_deterministic():
    def run():
        gen = torch.Generator().manual_seed(3)
        keys = torch.randn(KV, 200, DIM, generator=gen)
        tree = ChunkTree(SMALL, KV, DIM)
        for start in range(0, 200, 8):
            tree.append_keys(keys[:, start:start + 8], start)
        for _ in range(10):
            evaluate(tree, keys, gen, SelectConfig(budget=0.2, sinks=2, window=4),
                     torch.tensor([5, 77, 150]))
        return tree.bounds.tolist(), tree.ema.tolist()

    assert run() == run()


def test_bad_construction():
    with pytest.raises(ValueError, match="ChunkConfig"):
        ChunkTree({"min": 4}, KV, DIM)
    with pytest.raises(ValueError, match="kv_heads"):
        ChunkTree(SMALL, 0, DIM)


def _cold_tree(leaves=8, size=16):
    tree = ChunkTree(ChunkConfig(min=8, base=16, max=512, merge_after=1), 2, 4)
    gen = torch.Generator().manual_seed(3)
    for i in range(leaves):
        tree.append_keys(torch.randn(2, size, 4, generator=gen), record=i)
    return tree


def test_merge_respects_max_size():
    tree = _cold_tree()
    mass = torch.zeros(tree.num_leaves)
    mass[0] = 1.0
    merged = []
    for _ in range(12):
        mass = torch.zeros(tree.num_leaves)
        mass[0] = 1.0
        merged += tree.update(mass, torch.zeros(tree.num_leaves, dtype=torch.bool), max_size=40).merged
    assert merged, "cold leaves should merge"
    assert int(tree.sizes.max()) <= 40
    tree.validate()


def test_state_round_trip_and_refusal():
    tree = _cold_tree()
    mass = torch.zeros(tree.num_leaves)
    mass[0] = 1.0
    tree.update(mass, torch.zeros(tree.num_leaves, dtype=torch.bool))
    state = tree.state()
    again = _cold_tree(leaves=3)
    assert again.record_cuts.tolist() != state["records"].tolist()  # kept, then replaced
    again.load_state(state, lambda a, b: (a, b))
    assert torch.equal(again.record_cuts, state["records"])
    assert torch.equal(again.bounds, tree.bounds) and torch.equal(again.kmin, tree.kmin)
    assert [(r.start, r.end) for r in again.records] == [(r.start, r.end) for r in tree.records]
    bad = dict(state, records=state["records"] + 1)
    with pytest.raises(ValueError, match="tile"):
        ChunkTree(tree.config, 2, 4).load_state(bad, lambda a, b: None)


def test_rewrites_follow_leaves_but_never_cut_records_below_base():
    keys = torch.randn(KV, 64, DIM, generator=torch.Generator().manual_seed(5))
    tree, store = ChunkTree(ChunkConfig(min=2, base=8, max=64), KV, DIM), FakeStore()
    for start in range(0, 64, 16):
        tree.append_keys(keys[:, start:start + 16], store.put(keys[:, start:start + 16]))
    tree.split(SplitRequest(0, 16, 8, 0.9), keys[:, :16])       # 8 + 8: two 8-token records
    tree.split(SplitRequest(16, 32, 20, 0.9), keys[:, 16:32])   # 4 + 12: one record stays
    tree.split(SplitRequest(16, 20, 18, 0.9), keys[:, 16:20])   # 2 + 2 inside it
    assert tree.bounds.tolist() == [0, 8, 16, 18, 20, 32, 48, 64]
    assert [(rw.cuts, len(rw.old)) for rw in tree.pending_rewrites()] == [((0, 8, 16), 1)]
    store.rewrite_all(tree, torch.Generator().manual_seed(0))  # may commit or not
    for rw in tree.pending_rewrites():
        data = torch.cat([store.records.pop(r.handle) for r in rw.old], dim=1)
        tree.commit_rewrite(rw, [store.put(data[:, a - rw.cuts[0]:b - rw.cuts[0]])
                                 for a, b in zip(rw.cuts, rw.cuts[1:])])
    assert [(r.start, r.end) for r in tree.records] == [(0, 8), (8, 16), (16, 32), (32, 48),
                                                        (48, 64)]
    assert tree.pending_rewrites() == []
    check(tree, store, keys, every_leaf=True)
    cold = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])    # [32, 64) merges: one record
    for _ in range(6):
        tree.update(cold, torch.zeros(tree.num_leaves, dtype=torch.bool))
        cold = cold[:tree.num_leaves]
    assert tree.bounds.tolist()[-2:] == [32, 64]
    assert [(rw.cuts, len(rw.old)) for rw in tree.pending_rewrites()] == [((32, 64), 2)]


def test_record_cuts_keep_records_at_least_floor():
    from tierkv.records import record_cuts_for

    assert record_cuts_for([0, 2, 4, 6, 8], 8) == (0, 8)
    assert record_cuts_for([0, 8, 12, 16], 8) == (0, 8, 16)
    assert record_cuts_for([0, 4, 12, 16, 24], 8) == (0, 12, 24)
    assert record_cuts_for([0, 3], 8) == (0, 3)
    assert record_cuts_for([0, 2, 4, 8], 1) == (0, 2, 4, 8)


@pytest.mark.parametrize("seed", range(10))
def test_append_many_matches_appends_one_by_one(seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV, 200, DIM, generator=gen)
    one, many = ChunkTree(SMALL, KV, DIM), ChunkTree(SMALL, KV, DIM)
    one.append_keys(keys[:, :2], "tail")      # a short tail the first new leaf joins
    many.append_keys(keys[:, :2], "tail")
    sizes = torch.randint(SMALL.min, SMALL.base + 1, (30,), generator=gen)
    cuts = torch.cat([torch.tensor([2]), 2 + sizes.cumsum(0)])
    cuts = cuts[cuts <= 200]
    for a, b in zip(cuts.tolist(), cuts.tolist()[1:]):
        one.append_keys(keys[:, a:b], (a, b))
    lo, hi = summarize_segments(keys[:, 2:int(cuts[-1])], cuts - 2)
    records = [RecordRef((a, b), a, b) for a, b in zip(cuts.tolist(), cuts.tolist()[1:])]
    many.append_many(cuts, lo, hi, records)
    for name in ("bounds", "kmin", "kmax", "ema", "selected_count", "cold"):
        assert torch.allclose(getattr(one, name).double(), getattr(many, name).double()), name
    assert one.records == many.records
    many.validate()


def test_append_many_holds_several_leaves_per_record_and_checks_its_input():
    keys = torch.randn(KV, 16, DIM)
    tree = ChunkTree(ChunkConfig(min=2, base=8, max=64), KV, DIM)
    cuts = torch.tensor([0, 2, 4, 6, 8, 10, 12, 16])
    lo, hi = summarize_segments(keys, cuts)
    with pytest.raises(ValueError, match="tile"):
        tree.append_many(cuts, lo, hi, [RecordRef("a", 0, 8)])
    with pytest.raises(ValueError, match="kmin"):
        tree.append_many(cuts, lo[1:], hi[1:], [RecordRef("a", 0, 8), RecordRef("b", 8, 16)])
    with pytest.raises(ValueError, match="start at n=0"):
        tree.append_many(cuts + 1, lo, hi, [RecordRef("a", 1, 9), RecordRef("b", 9, 17)])
    with pytest.raises(ValueError, match="leaf sizes"):
        tree.append_many(torch.tensor([0, 1, 16]), lo[:2], hi[:2],
                         [RecordRef("a", 0, 8), RecordRef("b", 8, 16)])
    assert tree.n == 0 and tree.records == []             # nothing half-done
    tree.append_many(cuts, lo, hi, [RecordRef("a", 0, 8), RecordRef("b", 8, 16)])
    assert tree.sizes.tolist() == [2, 2, 2, 2, 2, 2, 4] and len(tree.records) == 2
    assert [r.handle for r in tree.records_for(torch.tensor([1, 5]))] == ["a", "b"]
    assert tree.pending_rewrites() == []


def test_split_packed_takes_the_leaves_keys_in_one_tensor():
    """``split_packed`` (every leaf's keys one after another, as a fold gathers them) splits as
    ``split_many`` does, and refuses keys of the wrong length without changing anything."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(KV, 128, DIM, generator=gen)
    tree = ChunkTree(SMALL, KV, DIM)
    for start in range(0, 128, 16):
        tree.append_keys(keys[:, start:start + 16], start)
    requests = [SplitRequest(80, 96, 86, 0.7), SplitRequest(16, 32, 20, 0.25)]
    expected = copy.deepcopy(tree)
    expected.split_many(requests, [keys[:, r.start:r.end] for r in requests])
    before = copy.deepcopy(tree)
    with pytest.raises(ValueError, match=rf"keys \(2, 31, {DIM}\): expected \(2, 32, {DIM}\)"):
        tree.split_packed(requests, torch.cat([keys[:, 80:96], keys[:, 16:31]], dim=1))
    assert torch.equal(tree.bounds, before.bounds) and torch.equal(tree.kmin, before.kmin)
    tree.split_packed(requests, torch.cat([keys[:, 80:96], keys[:, 16:32]], dim=1))
    tree.validate()
    for name in ("bounds", "kmin", "kmax", "ema", "selected_count", "cold"):
        assert torch.equal(getattr(tree, name), getattr(expected, name)), name
