"""The exact top-k oracles of ``bench.ceiling`` on random tensors (no model)."""
from __future__ import annotations

import pytest
import torch

from bench.ceiling import CHUNK, ORACLES, Oracle, OracleAttention, moved
from tierkv.config import SelectConfig

Q_HEADS, KV_HEADS, DIM = 6, 2, 16


class Layer:
    """What the attention function reads from a transformers attention module."""

    def __init__(self, index: int):
        self.layer_idx, self.num_key_value_groups = index, Q_HEADS // KV_HEADS
        self.is_causal, self.training = True, False


def tensors(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Q_HEADS, 1, DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, n, DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, n, DIM, generator=gen)
    return q, k, v


def full(q, k, v):
    k, v = (t.repeat_interleave(Q_HEADS // KV_HEADS, 1) for t in (k, v))
    return ((q @ k.transpose(-1, -2) * DIM ** -0.5).softmax(-1) @ v).transpose(1, 2)


def run(attention, layer, q, k, v):
    return attention(Layer(layer), q, k, v, None, scaling=DIM ** -0.5)[0]


def test_without_an_oracle_it_is_ordinary_attention():
    q, k, v = tensors(50)
    out = run(OracleAttention((2,)), 5, q, k, v)
    torch.testing.assert_close(out, full(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_a_budget_over_the_context_keeps_everything(name):
    attention = OracleAttention((1, 3))
    attention.oracle, attention.select = ORACLES[name], SelectConfig(budget=64, window=4)
    q, k, v = tensors(40)
    for layer in range(5):  # the filter layers run first, as in a forward
        out = run(attention, layer, q, k, v)
        torch.testing.assert_close(out, full(q, k, v), rtol=1e-5, atol=1e-5)


def test_per_head_oracle_keeps_each_heads_top_tokens():
    attention = OracleAttention((1,))
    attention.oracle, attention.select = Oracle("head", 1, False), SelectConfig(budget=5)
    q, k, v = tensors(30)
    keys = k.repeat_interleave(Q_HEADS // KV_HEADS, 1)
    probs = (q @ keys.transpose(-1, -2) * DIM ** -0.5).softmax(-1)
    keep = attention.kept(0, probs, KV_HEADS)
    assert keep.shape == probs.shape and bool((keep.sum(-1) == 5).all())
    for head in range(Q_HEADS):
        top = set(probs[0, head, 0].topk(5).indices.tolist())
        assert set(keep[0, head, 0].nonzero().flatten().tolist()) == top


def test_layer_oracle_keeps_sinks_window_and_heaviest_chunks_within_budget():
    attention = OracleAttention((1,))
    attention.oracle = Oracle("layer", 4, True)
    attention.select = SelectConfig(budget=20, sinks=2, window=6)
    n = 40
    weights = torch.zeros(n)
    weights[[9, 10, 21, 30]] = torch.tensor([0.5, 0.4, 0.3, 0.2])
    keep = attention.chosen(weights, n, 20)
    kept = set(keep.nonzero().flatten().tolist())
    assert {0, 1} | set(range(34, 40)) <= kept and len(kept) <= 20
    # chunks [8, 12) (mass 0.9) and [20, 24) (0.3) fit in the 12 tokens left; [28, 32) too
    assert set(range(8, 12)) | set(range(20, 24)) | set(range(28, 32)) <= kept


def test_layers_after_a_filter_reuse_its_choice():
    attention = OracleAttention((1,))
    attention.oracle, attention.select = Oracle("filter", 1, True), SelectConfig(budget=12, window=4)
    q, k, v = tensors(60)
    run(attention, 1, q, k, v)  # the filter layer: dense, records its weights
    weights = attention.weights[1]
    assert weights.shape == (60,)
    other = torch.randn(1, Q_HEADS, 1, 60)
    keep = attention.kept(7, other.softmax(-1), KV_HEADS)
    torch.testing.assert_close(keep.view(-1), attention.chosen(weights, 60, 12))


def test_dense_layers_attend_in_full_and_others_do_not():
    attention = OracleAttention((2,))
    attention.oracle, attention.select = Oracle("layer", 1, True), SelectConfig(budget=4, window=1)
    q, k, v = tensors(50)
    for layer in (0, 1, 2):
        torch.testing.assert_close(run(attention, layer, q, k, v), full(q, k, v),
                                   rtol=1e-5, atol=1e-5)
    assert not torch.allclose(run(attention, 3, q, k, v), full(q, k, v), atol=1e-4)


def test_kv_head_oracle_chooses_for_each_kv_head_and_its_query_heads():
    attention = OracleAttention((1,))
    attention.oracle = Oracle("kv_head", 1, True)
    attention.select = SelectConfig(budget=8, sinks=1, window=2)
    n, groups = 30, Q_HEADS // KV_HEADS
    probs = torch.full((1, Q_HEADS, 1, n), 1e-3)
    probs[0, 1, 0, 10] = 0.5   # a query head of KV head 0 singles out token 10
    probs[0, 4, 0, 20] = 0.5   # one of KV head 1, token 20
    keep = attention.kept(3, probs, KV_HEADS)
    assert keep.shape == probs.shape
    for head in range(Q_HEADS):
        kept = set(keep[0, head, 0].nonzero().flatten().tolist())
        assert len(kept) <= 8 and {0, 28, 29} <= kept
        assert (10 in kept) == (head < groups) and (20 in kept) == (head >= groups)


def test_sketch_oracle_of_full_rank_keeps_each_heads_exact_top_tokens():
    """A key sketch of full rank scores exactly: each head keeps its own top tokens, with the
    sinks and the window always in."""
    attention = OracleAttention((1,))
    attention.oracle = Oracle("head", 1, False, DIM)
    attention.select = SelectConfig(budget=9, sinks=2, window=3)
    q, k, v = tensors(30)
    keys = k.repeat_interleave(Q_HEADS // KV_HEADS, 1)
    logits = (q @ keys.transpose(-1, -2))[0, :, 0]
    keep = attention.kept(0, attention.sketch_scores(0, q, k), KV_HEADS)[0, :, 0]
    forced = {0, 1, 27, 28, 29}
    for head in range(Q_HEADS):
        rest = logits[head, 2:27].topk(4).indices + 2
        assert set(keep[head].nonzero().flatten().tolist()) == forced | set(rest.tolist())


def test_moved_counts_the_tokens_and_chunks_some_head_keeps():
    assert CHUNK == 8
    n = 20  # chunks [0, 8), [8, 16), [16, 20)
    keep = torch.zeros(1, 2, 1, n, dtype=torch.bool)
    keep[0, 0, 0, [1, 2]] = True
    keep[0, 1, 0, [2, 17]] = True
    tokens, chunks = moved(keep, n)
    assert tokens == pytest.approx(3 / 20) and chunks == pytest.approx(2 / 3)
