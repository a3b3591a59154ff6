"""Attention kernels: the decode accumulator against one softmax over everything."""
import pytest
import torch

import tierkv.kernels
from tierkv.attention import (DecodeAccumulator, attention_with_mass, causal_attention,
                              decode_attention, recent_query_mass, scored_decode_attention)

needs_native = pytest.mark.skipif(tierkv.kernels.decode_attend is None,
                                  reason="tierkv._native's kernels are not built or not for this CPU")


def _parts(n, cuts):
    edges = [0, *cuts, n]
    return list(zip(edges, edges[1:]))


@pytest.mark.parametrize("native", [False, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_parts_merge_to_the_whole(dtype, native):
    gen = torch.Generator().manual_seed(0)
    layers, q_heads, kv_heads, n, dim, scaling = 3, 8, 2, 300, 16, 0.25
    q = torch.randn(layers, q_heads, dim, generator=gen)
    k = torch.randn(layers, kv_heads, n, dim, generator=gen).to(dtype)
    v = torch.randn(layers, kv_heads, n, dim, generator=gen).to(dtype)
    acc = DecodeAccumulator(q, scaling, native=native)
    for a, b in _parts(n, [1, 64, 65, 200]):
        acc.add(k[..., a:b, :], v[..., a:b, :])
    out = acc.result()
    assert out.shape == (layers, q_heads, 1, dim) and out.dtype == torch.float32
    for layer in range(layers):
        whole = decode_attention(q[layer].unsqueeze(1), k[layer].float(), v[layer].float(), scaling)
        assert torch.allclose(out[layer], whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("native", [False, None])
@pytest.mark.parametrize("dim", [8, 6])  # the C kernel's and (not a multiple of 8) torch's
def test_large_scores_do_not_overflow(native, dim):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, dim, generator=gen) * 100
    k = torch.randn(2, 50, dim, generator=gen) * 100
    v = torch.randn(2, 50, dim, generator=gen)
    acc = DecodeAccumulator(q, 1.0, native=native)
    for a, b in _parts(50, [10, 11, 30]):
        acc.add(k[:, a:b], v[:, a:b])
    scores = q.double().view(2, 2, dim) @ k.double().transpose(1, 2)
    expected = (torch.softmax(scores, -1) @ v.double()).reshape(4, 1, dim)
    out = acc.result()
    assert torch.isfinite(out).all() and torch.allclose(out.double(), expected, atol=1e-5)


def test_result_needs_a_part():
    with pytest.raises(ValueError, match="no part"):
        DecodeAccumulator(torch.randn(4, 8), 1.0).result()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group, dim", [(1, 64), (3, 64), (4, 128), (8, 24), (9, 64), (3, 12)])
def test_native_kernel_equals_torchs_path(dtype, group, dim):
    """The C kernel (head_dim a multiple of 8, up to 8 query heads a group) and torch's path (the
    others, whatever ``native`` says), against fp64 attention over parts of odd sizes, some of
    them views."""
    gen = torch.Generator().manual_seed(group * 1000 + dim)
    layers, kv_heads, n = 2, 2, 157
    q = torch.randn(layers, kv_heads * group, dim, generator=gen)
    k = (torch.randn(layers, kv_heads, n, dim, generator=gen) * 2).to(dtype)
    v = torch.randn(layers, kv_heads, n, dim, generator=gen).to(dtype)
    scores = q.double().view(layers, kv_heads, group, dim) @ k.double().transpose(-1, -2)
    exact = (torch.softmax(scores * dim ** -0.5, -1) @ v.double()).view(layers, -1, 1, dim)
    for native in (False, True):
        acc = DecodeAccumulator(q, dim ** -0.5, native=native)
        for a, b in _parts(n, [1, 2, 5, 70, 71]):
            acc.add(k[..., a:b, :], v[..., a:b, :])
        assert torch.allclose(acc.result().double(), exact, rtol=1e-4, atol=1e-5)


@needs_native
def test_native_and_torch_parts_share_one_state():
    """Parts the kernel cannot take (here: values of another dtype than the keys) go through
    torch's path into the same running state."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 32, generator=gen)
    k = torch.randn(2, 90, 32, generator=gen).half()
    v = torch.randn(2, 90, 32, generator=gen).half()
    acc = DecodeAccumulator(q, 0.2)
    acc.add(k[:, :30], v[:, :30])  # kernel
    acc.add(k[:, 30:60], v[:, 30:60].float())  # torch: fp32 values
    acc.add(k[:, 60:].transpose(1, 2).contiguous().transpose(1, 2), v[:, 60:])  # kernel, a view
    whole = decode_attention(q.unsqueeze(1), k.float(), v.float(), 0.2)
    assert torch.allclose(acc.result(), whole, rtol=1e-4, atol=1e-5)


@needs_native
def test_native_kernel_reads_fp16_subnormals_infinities_and_nan_as_torch_does():
    """Subnormal fp16 keys and values convert exactly, an infinite key takes all the attention
    of the heads it meets, a NaN spreads."""
    q = torch.tensor([[1.0, -1.0, 0.5, 0.0, 2.0, 1.0, -0.5, 0.25]] * 2)
    k = torch.tensor([[[6e-8, -3e-5, 1e-7, 0.0, 5e-6, -6e-8, 2e-7, 0.0],
                       [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]]]).half()
    v = torch.tensor([[[6e-8, 1e-6, -2e-5, 3.0, 0.0, 1.0, 5e-8, -1.0],
                       [-1.0, 2e-7, 0.5, 4e-6, 1.0, 0.0, 3e-7, 2.0]]]).half()
    outs = []
    for native in (False, True):
        acc = DecodeAccumulator(q, 1.0, native=native)
        acc.add(k, v)
        outs.append(acc.result())
    assert torch.allclose(outs[1], outs[0], rtol=1e-6, atol=0)
    k[0, 1, 0], v[0, 0, 1] = float("inf"), float("nan")
    for native in (False, True):
        acc = DecodeAccumulator(q, 1.0, native=native)
        acc.add(k, v)
        assert torch.isnan(acc.result()).all()


def test_bad_parts_are_named_before_any_kernel_runs():
    q = torch.randn(2, 8, 16)  # (layers, q_heads, head_dim)
    for native in (False, None):
        acc = DecodeAccumulator(q, 1.0, native=native)
        with pytest.raises(ValueError, match="keys"):
            acc.add(torch.randn(3, 4, 5, 16), torch.randn(3, 4, 5, 16))  # 3 layers, not 2
        with pytest.raises(ValueError, match="keys"):
            acc.add(torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16))  # 3 kv heads into 8
        with pytest.raises(ValueError, match="keys"):
            acc.add(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8))  # head_dim 8
        with pytest.raises(ValueError, match="n >= 1"):
            acc.add(torch.randn(2, 4, 0, 16), torch.randn(2, 4, 0, 16))
        with pytest.raises(ValueError, match="values"):
            acc.add(torch.randn(2, 4, 5, 16), torch.randn(2, 4, 6, 16))
        acc.add(torch.randn(2, 4, 5, 16).half(), torch.randn(2, 4, 5, 16).half())
        with pytest.raises(ValueError, match="parts before had 4"):
            acc.add(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16))  # same numel, 2 kv heads
    with pytest.raises(ValueError, match="native"):
        DecodeAccumulator(q, 1.0, native="yes")
    with pytest.raises(ValueError, match="q_heads, head_dim"):
        DecodeAccumulator(torch.randn(16), 1.0)


def test_native_true_needs_the_kernel(monkeypatch):
    monkeypatch.setattr(tierkv.kernels, "decode_attend", None)
    with pytest.raises(ValueError, match="not built"):
        DecodeAccumulator(torch.randn(4, 8), 1.0, native=True)
    acc = DecodeAccumulator(torch.randn(4, 8), 1.0)  # falls back to torch's path
    acc.add(torch.randn(2, 3, 8).half(), torch.randn(2, 3, 8).half())
    assert acc.result().shape == (4, 1, 8)


def test_kernel_limits_are_what_the_kernels_take():
    fits = tierkv.kernels.fits
    assert fits(1, 8, torch.float16) and fits(8, 128, torch.bfloat16) and fits(3, 64, torch.float32)
    assert not fits(9, 64, torch.float16) and not fits(0, 64, torch.float16)
    assert not fits(3, 12, torch.float16) and not fits(3, 64, torch.float64)


@needs_native
@pytest.mark.parametrize("g, d, kind", [(9, 64, 1), (3, 12, 1), (3, 64, 3), (0, 64, 1)])
def test_the_kernels_refuse_what_they_do_not_take(g, d, kind):
    """Beyond their limits the kernels raise before reading any address (these are 0)."""
    with pytest.raises(ValueError, match="no kernel"):
        tierkv.kernels.decode_attend(0, 0, 0, 0, 0, 0, 1, g, 1, d, kind)
    with pytest.raises(ValueError, match="no kernel"):
        tierkv.kernels.bound_scores(0, 0, 0, 0, 1, 1, g, d, kind, 0.0)


def _causal_reference(q, k, v, scaling):
    """Causal attention in float64 over the whole (q_heads, t, n) score matrix, and each key's
    attention mass summed over queries and the query heads of its GQA group."""
    heads, t, _ = q.shape
    kv_heads, n, _ = k.shape
    group = heads // kv_heads
    kk, vv = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = q.double() @ kk.transpose(1, 2) * scaling
    rows = torch.arange(n - t, n).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(n).unsqueeze(0) > rows, float("-inf"))
    probs = scores.softmax(-1)
    return probs @ vv, probs.view(kv_heads, group, t, n).sum(dim=(1, 2))


@pytest.mark.parametrize("expand_gqa", [None, True, False])
@pytest.mark.parametrize("heads, kv_heads, t, n, block", [
    (9, 3, 37, 37, 16),     # a prompt alone, blocks that do not divide it
    (9, 3, 20, 75, 512),    # new tokens after 55 held ones, one block
    (4, 4, 33, 100, 8),     # no GQA
    (8, 2, 1, 30, 4),       # one token
])
def test_causal_attention_is_exact_in_blocks(heads, kv_heads, t, n, block, expand_gqa):
    """Query-blocked causal attention equals the whole-matrix one, with the keys repeated for
    their GQA group or passed to SDPA grouped, and its column mass (H2O's) is the same."""
    gen = torch.Generator().manual_seed(heads * n + t)
    q = torch.randn(heads, t, 16, generator=gen)
    k, v = torch.randn(2, kv_heads, n, 16, generator=gen)
    ref, ref_mass = _causal_reference(q, k, v, 0.25)
    out, mass = causal_attention(q, k, v, 0.25, block, expand_gqa=expand_gqa)
    assert mass is None
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()
    out, mass = causal_attention(q, k, v, 0.25, block, column_mass=True, expand_gqa=expand_gqa)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(mass.double(), ref_mass, atol=1e-4)


def test_blocks_that_keep_probabilities_stay_under_their_byte_cap(monkeypatch):
    """With ``column_mass`` a block's fp32 scores stay within ``MASS_BLOCK_BYTES`` (here 3 rows
    of 9 heads over 75 keys), and the result is the same."""
    import tierkv.attention as attention

    heads, kv_heads, t, n = 9, 3, 20, 75
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(heads, t, 16, generator=gen)
    k, v = torch.randn(2, kv_heads, n, 16, generator=gen)
    ref, ref_mass = _causal_reference(q, k, v, 0.25)
    monkeypatch.setattr(attention, "MASS_BLOCK_BYTES", 4 * heads * n * 3)
    probs, rows = attention._probs, []
    monkeypatch.setattr(attention, "_probs", lambda qb, *a: rows.append(qb.shape[1]) or probs(qb, *a))
    out, mass = causal_attention(q, k, v, 0.25, 512, column_mass=True)
    assert rows == [3] * 6 + [2]
    assert torch.allclose(out.double(), ref, atol=1e-5) and torch.allclose(mass.double(), ref_mass, atol=1e-4)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_strided_rows_in_place(dtype):
    """``decode_attention`` on a CPU goes through the kernel, which reads a block's first
    ``n`` tokens where they lie (each head's row ``room`` tokens after the last): the same
    attention as SDPA over a copy. Rows that are not evenly apart are copied first."""
    gen = torch.Generator().manual_seed(7)
    block = torch.randn(3, 3, 300, 64, generator=gen).to(dtype)  # (layers, kv heads, room, dim)
    values = torch.randn(3, 3, 300, 64, generator=gen).to(dtype)
    q = torch.randn(9, 1, 64, generator=gen).to(dtype)
    for k, v in ((block[1, :, :250], values[1, :, :250]),
                 (block[:, 1, :250], values[:, 1, :250])):          # rows a layer apart
        exact = torch.nn.functional.scaled_dot_product_attention(
            q.float()[None], k.contiguous().float()[None], v.contiguous().float()[None],
            scale=0.125, enable_gqa=True)[0]
        got = decode_attention(q, k, v, 0.125)
        assert got.dtype == dtype and got.shape == (9, 1, 64)
        assert torch.allclose(got.float(), exact, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                              atol=1e-2 if dtype != torch.float32 else 1e-6)
    uneven = block[:2, :2, :250], values[:2, :2, :250]  # a layer is 3 rows on, not 2
    q = torch.randn(2, 6, 64, generator=gen)
    whole, parts = DecodeAccumulator(q, 0.125, native=True), DecodeAccumulator(q, 0.125, native=False)
    whole.add(*uneven)
    parts.add(*(t.contiguous() for t in uneven))
    assert torch.allclose(whole.result(), parts.result(), rtol=1e-4, atol=1e-5)


@needs_native
def test_the_kernel_refuses_rows_closer_than_their_tokens():
    with pytest.raises(ValueError, match="stride=3"):
        tierkv.kernels.decode_attend(0, 0, 0, 0, 0, 0, 2, 3, 4, 64, 0, 3)


@pytest.mark.parametrize("t,queries", [(40, 8), (5, 8), (1, 32)])
def test_recent_query_mass_is_their_causal_softmax_summed(t, queries):
    """The mass the last ``queries`` new queries pay each key: causal, GQA, rows of one."""
    gen = torch.Generator().manual_seed(3)
    q_heads, kv_heads, n, dim, scaling = 6, 2, 70, 16, 0.3
    q = torch.randn(q_heads, t, dim, generator=gen)
    k = torch.randn(kv_heads, n, dim, generator=gen)
    got = recent_query_mass(q, k, scaling, queries)
    want = torch.zeros(n)
    for h in range(q_heads):
        for i in range(max(0, t - queries), t):
            seen = n - t + i + 1
            want[:seen] += torch.softmax(q[h, i] @ k[h // (q_heads // kv_heads), :seen].T * scaling, 0)
    assert got.shape == (n,) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5)
    assert got.sum().item() == pytest.approx(q_heads * min(t, queries), rel=1e-5)


@pytest.mark.parametrize("heads, kv_heads, t, n", [(9, 3, 18, 90), (4, 4, 1, 30), (8, 2, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_mass_is_both_in_one_pass(heads, kv_heads, t, n, dtype):
    """A short prompt's attention and the mass its queries pay each key, from one set of
    probabilities: the output of ``causal_attention`` and the mass of ``recent_query_mass``
    over all of its queries."""
    gen = torch.Generator().manual_seed(heads * n + t)
    q = torch.randn(heads, t, 16, generator=gen).to(dtype)
    k, v = torch.randn(2, kv_heads, n, 16, generator=gen).to(dtype)
    out, mass = attention_with_mass(q, k, v, 0.25)
    ref, _ = _causal_reference(q.float(), k.float(), v.float(), 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    assert torch.allclose(out.double(), ref, atol=tol), (out.double() - ref).abs().max()
    assert mass.dtype == torch.float32
    assert torch.allclose(mass, recent_query_mass(q, k, 0.25, t), atol=1e-5)
    assert torch.allclose(mass, recent_query_mass(q, k, 0.25, 64), atol=1e-5)
    # a question's: the mass of its last queries, and each key's largest weight over them all
    again, last, peak = attention_with_mass(q, k, v, 0.25, peak=True, queries=5)
    assert torch.equal(again, out)
    assert torch.allclose(last, recent_query_mass(q, k, 0.25, 5), atol=1e-5)
    scores = q.double() @ k.double().repeat_interleave(heads // kv_heads, 0).transpose(1, 2) * 0.25
    causal = torch.arange(n).unsqueeze(0) <= torch.arange(n - t, n).unsqueeze(1)
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    assert torch.allclose(peak.double(), probs.amax(dim=(0, 1)), atol=1e-5 if dtype == torch.float32 else 2e-2)
    # held a block of queries at a time, down to one query: the same figures
    per_query = 4 * (heads // kv_heads) * n
    for block_bytes in (per_query, 5 * per_query - 1):
        blocked, blocked_last, blocked_peak = attention_with_mass(
            q, k, v, 0.25, peak=True, queries=5, block_bytes=block_bytes)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(blocked.float(), out.float(), atol=tol)
        assert torch.allclose(blocked_last, last, atol=1e-6)
        assert torch.allclose(blocked_peak, peak, atol=1e-6)


def test_degenerate_shapes_refused_by_name():
    """Query tokens no more than the keys (their own are the last), over keys of at least one
    kv head and token: anything else is refused naming the shapes (before: the kernel used only
    the first of several query tokens, and empty heads divided by zero)."""
    k = v = torch.randn(2, 5, 8)
    for q in (torch.randn(4, 6, 8), torch.randn(4, 1, 0), torch.randn(0, 1, 8)):
        with pytest.raises(ValueError, match="decode_attention: q"):
            decode_attention(q, k, v, 1.0)
    with pytest.raises(ValueError, match="decode_attention"):
        decode_attention(torch.randn(4, 1, 8), torch.randn(0, 5, 8), torch.randn(0, 5, 8), 1.0)
    with pytest.raises(ValueError, match="kv_heads dividing"):
        DecodeAccumulator(torch.randn(4, 8), 1.0).add(torch.randn(0, 3, 8), torch.randn(0, 3, 8))
    with pytest.raises(ValueError, match="none empty"):
        DecodeAccumulator(torch.randn(0, 4, 8), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_query_tokens_see_the_keys_up_to_their_own(dtype):
    """A pass verifying drafted tokens attends as a decode step: ``t`` query tokens over ``n``
    keys whose last ``t`` are their own, token ``i`` seeing keys ``[0, n - t + i]``; each
    equals a one-token step over its keys, and the probabilities stack the tokens as heads
    (0 past a token's own key), so their largest and summed weights span heads and tokens."""
    torch.manual_seed(3)
    t, n = 5, 40
    q = torch.randn(6, t, 16).to(dtype)
    k, v = torch.randn(2, n, 16).to(dtype), torch.randn(2, n, 16).to(dtype)
    steps = [decode_attention(q[:, i:i + 1], k[:, :n - t + 1 + i], v[:, :n - t + 1 + i], 0.25)
             for i in range(t)]
    want = torch.cat(steps, dim=1).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(decode_attention(q, k, v, 0.25).float(), want, atol=tol)
    out, probs = scored_decode_attention(q, k, v, 0.25)
    assert torch.allclose(out.float(), want, atol=tol)
    assert probs.shape == (2, 3 * t, n)
    rows = probs.view(2, 3, t, n)
    for i in range(t):
        assert torch.all(rows[:, :, i, n - t + 1 + i:] == 0)
        _, one = scored_decode_attention(q[:, i:i + 1], k[:, :n - t + 1 + i], v[:, :n - t + 1 + i], 0.25)
        assert torch.allclose(rows[:, :, i, :n - t + 1 + i], one.view(2, 3, -1), atol=1e-5)
    allowed = torch.ones(2, 1, 1, n, dtype=torch.bool)
    allowed[1, ..., 3] = False  # a mask of the caller's still holds beside the tokens' own
    _, masked = scored_decode_attention(q, k, v, 0.25, allowed)
    assert torch.all(masked[1, :, 3] == 0) and torch.all(masked[0, :, 3] > 0)
    with pytest.raises(ValueError, match="query tokens over"):
        scored_decode_attention(torch.randn(6, 7, 16), k[:, :6], v[:, :6], 0.25)
