"""Attention kernels: the decode accumulator against one softmax over everything."""
import pytest
import torch

from tierkv.attention import DecodeAccumulator, decode_attention


def _parts(n, cuts):
    edges = [0, *cuts, n]
    return list(zip(edges, edges[1:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_parts_merge_to_the_whole(dtype):
    gen = torch.Generator().manual_seed(0)
    layers, q_heads, kv_heads, n, dim, scaling = 3, 8, 2, 300, 16, 0.25
    q = torch.randn(layers, q_heads, dim, generator=gen)
    k = torch.randn(layers, kv_heads, n, dim, generator=gen).to(dtype)
    v = torch.randn(layers, kv_heads, n, dim, generator=gen).to(dtype)
    acc = DecodeAccumulator(q, scaling)
    for a, b in _parts(n, [1, 64, 65, 200]):
        acc.add(k[..., a:b, :], v[..., a:b, :])
    out = acc.result()
    assert out.shape == (layers, q_heads, 1, dim) and out.dtype == torch.float32
    for layer in range(layers):
        whole = decode_attention(q[layer].unsqueeze(1), k[layer].float(), v[layer].float(), scaling)
        assert torch.allclose(out[layer], whole, rtol=1e-5, atol=1e-6)


def test_large_scores_do_not_overflow():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, generator=gen) * 100
    k = torch.randn(2, 50, 8, generator=gen) * 100
    v = torch.randn(2, 50, 8, generator=gen)
    acc = DecodeAccumulator(q, 1.0)
    for a, b in _parts(50, [10, 11, 30]):
        acc.add(k[:, a:b], v[:, a:b])
    scores = q.double().view(2, 2, 8) @ k.double().transpose(1, 2)
    expected = (torch.softmax(scores, -1) @ v.double()).reshape(4, 1, 8)
    out = acc.result()
    assert torch.isfinite(out).all() and torch.allclose(out.double(), expected, atol=1e-5)


def test_result_needs_a_part():
    with pytest.raises(ValueError, match="no part"):
        DecodeAccumulator(torch.randn(4, 8), 1.0).result()
