"""Min/max summaries and the upper-bound score (tierkv.summary)."""
import pytest
import torch

import tierkv.kernels
from tierkv.summary import (attention_shares, bound_scores, chunk_scores, criticality,
                            merge_summaries, rounding_margin, segment_minmax, summarize,
                            summarize_segments)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
NATIVE = tierkv.kernels.bound_scores
needs_native = pytest.mark.skipif(NATIVE is None,
                                  reason="tierkv._native's kernels are not built or not for this CPU")


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Each bound test on both paths: the C kernel (where built) and torch's."""
    if request.param == "native" and NATIVE is None:
        pytest.skip("tierkv._native's kernels are not built or not for this CPU")
    if request.param == "torch":
        monkeypatch.setattr(tierkv.kernels, "bound_scores", None)
    return request.param


def random_bounds(gen, n, max_len):
    cuts = [0]
    while cuts[-1] < n:
        cuts.append(min(n, cuts[-1] + int(torch.randint(1, max_len + 1, (1,), generator=gen))))
    return torch.tensor(cuts)


def random_keys(gen, kv_heads, n, dim, dtype):
    """Keys with mixed scales and outlier channels, like post-RoPE keys."""
    scale = torch.exp(torch.randn(kv_heads, 1, dim, generator=gen) * 1.5)
    keys = torch.randn(kv_heads, n, dim, generator=gen) * scale
    return keys.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_bound_never_below_true_max(dtype, group, path):
    gen = torch.Generator().manual_seed(10 * DTYPES.index(dtype) + group)
    kv_heads, dim, n = 3, 64, 6000
    keys = random_keys(gen, kv_heads, n, dim, dtype)
    bounds = random_bounds(gen, n, 12)  # ~900 chunks of 1 to 12 tokens: two scoring blocks
    kmin, kmax = summarize_segments(keys, bounds)
    segment = torch.repeat_interleave(torch.arange(bounds.numel() - 1), bounds.diff())
    k32, k64 = keys.float(), keys.double()
    for _ in range(10):  # 10 queries x ~500 chunks x 3 GQA groupings x 3 dtypes
        q = (torch.randn(kv_heads * group, dim, generator=gen) * 4).to(dtype).float()
        qg = q.view(kv_heads, group, dim)
        bound = bound_scores(q, kmin, kmax)  # (m, kv_heads, group)
        for dots in (torch.einsum("hgd,hnd->nhg", qg.double(), k64),
                     torch.einsum("hgd,hnd->nhg", qg, k32).double()):
            true_max = torch.full(bound.shape, -float("inf"), dtype=torch.float64)
            true_max.scatter_reduce_(0, segment[:, None, None].expand_as(dots), dots, "amax")
            assert bool((bound.double() >= true_max).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_summaries_kept_in_the_keys_dtype_score_as_fp32(dtype):
    """min/max of fp16 / bf16 keys are fp16 / bf16 values: keeping the summaries in that dtype
    (half the memory) changes no bound, in any scoring block."""
    gen = torch.Generator().manual_seed(7)
    keys = random_keys(gen, 2, 3000, 64, dtype)
    kmin, kmax = summarize_segments(keys, random_bounds(gen, 3000, 4))  # ~1200 chunks
    assert kmin.shape[0] > 1024
    q = torch.randn(6, 64, generator=gen)
    narrow = bound_scores(q, kmin.to(dtype), kmax.to(dtype))
    assert torch.equal(narrow, bound_scores(q, kmin, kmax))
    assert torch.equal(chunk_scores(q, kmin.to(dtype), kmax.to(dtype))[1],
                       chunk_scores(q, kmin, kmax)[1])


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group, dim", [(1, 64), (3, 64), (4, 128), (8, 16), (9, 64), (3, 12)])
def test_native_bounds_equal_torchs_up_to_rounding(dtype, group, dim, monkeypatch):
    """The C kernel (torch's path for head_dim 12 or 9 query heads a group, beyond its limits)
    against torch's: the same bounds within the fp32 rounding of d-term sums in another order."""
    gen = torch.Generator().manual_seed(group * 100 + dim)
    keys = random_keys(gen, 2, 700, dim, dtype)
    kmin, kmax = summarize_segments(keys, random_bounds(gen, 700, 5))
    q = torch.randn(2 * group, dim, generator=gen) * 3
    native = bound_scores(q, kmin.to(dtype), kmax.to(dtype))
    scale = torch.einsum("hgd,mhd->mhg", q.abs().view(2, group, dim),
                         torch.maximum(kmin.abs(), kmax.abs()).float())
    monkeypatch.setattr(tierkv.kernels, "bound_scores", None)
    reference = bound_scores(q, kmin.to(dtype), kmax.to(dtype))
    assert native.shape == reference.shape and native.dtype == torch.float32
    assert bool(((native - reference).abs() <= 8 * dim * 2.0 ** -24 * scale).all())


def test_single_key_bound_is_tight():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 50, 32, generator=gen)
    q = torch.randn(4, 32, generator=gen)
    kmin, kmax = summarize_segments(keys, torch.arange(51))
    exact = torch.einsum("hgd,hnd->nhg", q.view(2, 2, 32), keys)
    assert torch.allclose(bound_scores(q, kmin, kmax), exact, rtol=0, atol=1e-3)


def test_segments_match_per_chunk_summaries():
    gen = torch.Generator().manual_seed(2)
    keys = random_keys(gen, 2, 300, 16, torch.bfloat16)
    bounds = random_bounds(gen, 300, 40)
    kmin, kmax = summarize_segments(keys, bounds)
    for i, (a, b) in enumerate(zip(bounds.tolist(), bounds[1:].tolist())):
        lo, hi = summarize(keys[:, a:b])
        assert torch.equal(kmin[i], lo) and torch.equal(kmax[i], hi)
        assert lo.dtype == torch.float32


def test_merge_equals_summary_of_union():
    gen = torch.Generator().manual_seed(3)
    keys = random_keys(gen, 3, 200, 8, torch.float16)
    kmin, kmax = summarize_segments(keys, random_bounds(gen, 200, 30))
    lo, hi = merge_summaries(kmin, kmax)
    whole = summarize(keys)
    assert torch.equal(lo, whole[0]) and torch.equal(hi, whole[1])
    outer = torch.tensor([0, 2, kmin.shape[0]])
    lo2, hi2 = segment_minmax(kmin, kmax, outer)
    assert torch.equal(lo2[1], merge_summaries(kmin[2:], kmax[2:])[0])
    assert torch.equal(hi2[0], merge_summaries(kmin[:2], kmax[:2])[1])


def test_chunk_scores_reduce_groups_then_heads():
    gen = torch.Generator().manual_seed(4)
    kmin = torch.randn(7, 3, 16, generator=gen)
    kmax = kmin + torch.rand(7, 3, 16, generator=gen)
    q = torch.randn(12, 16, generator=gen)
    full = bound_scores(q, kmin, kmax)
    per_head, per_layer = chunk_scores(q, kmin, kmax)
    assert per_head.shape == (7, 3) and per_layer.shape == (7,)
    assert torch.equal(per_head, full.amax(2)) and torch.equal(per_layer, full.amax((1, 2)))
    assert rounding_margin(q, kmin, kmax).shape == (7,)


def test_criticality_keeps_each_heads_ranking_whatever_its_scale():
    gen = torch.Generator().manual_seed(5)
    kmin = torch.randn(40, 1, 16, generator=gen)
    kmax = kmin + torch.rand(40, 1, 16, generator=gen)
    q = torch.randn(1, 16, generator=gen)
    sizes = torch.full((40,), 8)
    score = criticality(q, kmin, kmax, sizes)
    assert torch.equal(score.argsort(), bound_scores(q, kmin, kmax).flatten().argsort())
    assert torch.allclose(criticality(q * 50, kmin, kmax, sizes), score, atol=1e-4)


def test_criticality_lets_a_standout_chunk_of_a_tight_head_beat_a_loose_head():
    # head 0: loose bounds everywhere (large, varied scores); head 1: tight bounds, one chunk
    # far above its others. On raw bounds head 0's best wins; per head, head 1's chunk does.
    gen = torch.Generator().manual_seed(6)
    m, dim = 30, 16
    kmin = torch.randn(m, 2, dim, generator=gen) * 0.1
    kmax = kmin.clone()
    kmax[:, 0] += 20 * torch.rand(m, dim, generator=gen)
    q = torch.ones(2, dim)
    kmin[7, 1] += 1.0
    kmax[7, 1] += 1.0
    sizes = torch.full((m,), 8)
    assert int(chunk_scores(q, kmin, kmax)[1].argmax()) != 7
    assert int(criticality(q, kmin, kmax, sizes).argmax()) == 7


def test_criticality_charges_a_chunk_for_its_size_and_handles_edge_cases():
    gen = torch.Generator().manual_seed(7)
    kmin = torch.randn(1, 2, 8, generator=gen).repeat(6, 1, 1)
    kmax = kmin + 1
    kmin[0] -= 1  # chunk 0 is looser than the others
    q = torch.randn(4, 8, generator=gen)
    score = criticality(q, kmin, kmax, torch.tensor([8, 8, 64, 8, 8, 8]))
    assert score[2] < score[1] and torch.allclose(score[1], score[3])
    assert criticality(q, kmin[:1], kmax[:1], torch.tensor([8])).tolist() == [0.0]
    assert criticality(q, kmin[:0], kmax[:0], torch.zeros(0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize("group", [1, 3])
def test_attention_shares_of_one_token_chunks_are_the_mean_attention(group):
    gen = torch.Generator().manual_seed(8)
    keys = torch.randn(2, 50, 16, generator=gen) * 2  # 50 one-token chunks
    q = torch.randn(2 * group, 16, generator=gen)
    kmin, kmax = summarize_segments(keys, torch.arange(51))
    logits = torch.einsum("hgd,hnd->hgn", q.view(2, group, 16), keys) * 16 ** -0.5
    expected = logits.softmax(-1).mean((0, 1))
    assert torch.allclose(attention_shares(q, kmin, kmax).exp(), expected, atol=1e-6)
    assert torch.allclose(attention_shares(q, kmin, kmax, scale=1.0).exp().sum(), torch.tensor(1.0))


def test_attention_shares_weigh_heads_equally():
    # head 0 (large query) is sure of chunk 0, head 1 (small query) mildly prefers chunk 1:
    # each head holds half the estimate, so chunk 1 is not crowded out by head 0's scale
    kmin = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 0.0]]])
    q = torch.tensor([[100.0, 0.0], [0.0, 2.0]])
    shares = attention_shares(q, kmin, kmin, scale=1.0).exp()
    assert shares[0] > 0.49 and shares[1] > shares[2] and shares[1] > 0.3


def test_bad_inputs_raise():
    keys = torch.randn(2, 10, 8)
    with pytest.raises(ValueError, match="bounds"):
        summarize_segments(keys, torch.tensor([0, 5, 5, 10]))
    with pytest.raises(ValueError, match="bounds"):
        summarize_segments(keys, torch.tensor([0, 11]))
    with pytest.raises(ValueError, match="dtype"):
        summarize(keys.to(torch.int32))
    with pytest.raises(ValueError, match="keys"):
        summarize(keys[0])
    with pytest.raises(ValueError, match="query"):
        bound_scores(torch.randn(3, 8), *summarize_segments(keys, torch.tensor([0, 10])))
