"""Attention over a fetch's records where they lie (tierkv.scattered, the parts kernel) and the
unpacked CPU delivery of the pipeline."""
import pytest
import torch

import tierkv.kernels
from tierkv.attention import scored_decode_attention
from tierkv.pipeline import FetchPlan, Pipeline
from tierkv.shapes import KVShape
from tierkv.scattered import (LayerParts, Scattered, attend_parts, group_table, layer_parts,
                              reads_in_place)
from tierkv.scattered import scattered as scatter
from tierkv.storage.base import KVBlock

needs_kernel = pytest.mark.skipif(tierkv.kernels.decode_attend_parts is None,
                                  reason="tierkv._native's kernels are not built for this CPU")


def scattered(dtype, sizes=(8, 8, 32, 5, 128, 1), layers=3, heads=3, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    parts = [KVBlock(torch.randn(layers, heads, n, dim, generator=g).to(dtype),
                     torch.randn(layers, heads, n, dim, generator=g).to(dtype)) for n in sizes]
    # a record held as a view of a larger block: read from a contiguous copy
    big = KVBlock(torch.randn(layers, heads, 40, dim, generator=g).to(dtype),
                  torch.randn(layers, heads, 40, dim, generator=g).to(dtype))
    parts.append(KVBlock(big.keys[:, :, 3:19], big.values[:, :, 3:19]))
    return scatter(parts)


def window(dtype, heads=3, dim=64, w=7, room=50, seed=1):
    """A recent window as decode holds it: the first ``w`` tokens of a buffer with room."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(heads, room, dim, generator=g).to(dtype) for _ in range(2))
    return k[:, :w], v[:, :w]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("w", [0, 7])
def test_parts_attend_as_their_packed_copy(dtype, kept, w):
    block = scattered(dtype)
    tokens = sum(p.keys.shape[2] for p in block.parts)
    keep = None
    if kept:  # runs that cross records, single tokens, a record's last token
        keep = torch.tensor(sorted(set(torch.randint(0, tokens, (70,),
                                                     generator=torch.Generator().manual_seed(2)).tolist())))
    q = torch.randn(9, 1, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    table = group_table(block, keep)
    for slot in range(3):
        parts = LayerParts(table, slot, *window(dtype, w=w))
        k, v = parts.packed()
        assert k.shape[1] == parts.tokens == (tokens if keep is None else keep.numel()) + w
        want, want_probs = scored_decode_attention(q, k, v, 0.125)
        out, probs = attend_parts(q, parts, 0.125, scored=True)
        assert out.dtype == dtype and out.shape == (9, 1, 64) and probs.shape == (3, 3, parts.tokens)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out.float(), want.float(), atol=tol, rtol=0)
        assert torch.allclose(probs, want_probs, atol=1e-5 if dtype == torch.float32 else 1e-3)
        assert torch.equal(attend_parts(q, parts, 0.125), out)
        index = torch.tensor([0, 3, parts.group.tokens - 1, 5])  # a fold's split leaves' tokens
        assert torch.equal(parts.keys_at(index), k.index_select(1, index))


@needs_kernel
def test_a_table_row_is_a_run_of_kept_tokens_within_one_record():
    block = scattered(torch.float32, sizes=(4, 4, 4))  # a fourth part: 16 tokens, a view
    keep = torch.tensor([0, 1, 2, 3, 4, 5, 9, 11, 12, 20])  # 0-5 spans two records
    table = group_table(block, keep)
    assert table.table[:, 6].tolist() == [4, 2, 1, 1, 1, 1]
    assert table.tokens == 10
    first = block.parts[1].keys
    assert table.table[1, 0] == first.data_ptr()  # the second run starts the second record
    assert table.table[2, 0] == block.parts[2].keys.data_ptr() + 1 * 64 * 4  # token 9: 1 into it
    assert table.parts[3].keys.is_contiguous()  # the view was copied
    assert table.table[5, 0] == table.parts[3].keys.data_ptr() + 8 * 64 * 4  # its token 20


@needs_kernel
def test_a_record_that_is_not_contiguous_is_copied_first():
    k = torch.randn(3, 3, 64, 10).transpose(2, 3)  # (layers, heads, 10 tokens, 64): rows apart
    block = scatter([KVBlock(k, k.clone())])
    table = group_table(block, None)
    assert table.parts[0].keys.is_contiguous() and table.table[0, 0] != k.data_ptr()
    q = torch.randn(9, 1, 64)
    parts = LayerParts(table, 1, *window(torch.float32, w=0))
    assert torch.allclose(attend_parts(q, parts, 0.1),
                          scored_decode_attention(q, k[1].contiguous(), k[1].contiguous(), 0.1)[0],
                          atol=1e-5)


def test_a_group_table_is_made_once_a_step_for_its_layers():
    block = scattered(torch.float32)
    step = {}
    wk, wv = window(torch.float32)
    first = layer_parts(step, 4, block, None, 0, wk, wv)
    second = layer_parts(step, 4, block, None, 2, wk, wv)
    assert first.group is second.group and second.slot == 2
    keep = torch.tensor([1, 2, 3])
    assert layer_parts(step, 4, block, keep, 0, wk, wv).group.tokens == 3  # another selection
    assert layer_parts(step, 4, scatter(block.parts), keep, 0, wk, wv).group is not first.group


@needs_kernel
def test_records_window_and_query_that_do_not_match_are_refused():
    table = group_table(scattered(torch.float32), None)
    q = torch.randn(9, 1, 64)
    for wk, wv, query in [(*window(torch.float16), q), (*window(torch.float32, heads=2), q),
                          (*window(torch.float32), torch.randn(9, 1, 32)),
                          (*window(torch.float32), torch.randn(8, 1, 64))]:
        with pytest.raises(ValueError, match="do not match"):
            attend_parts(query, LayerParts(table, 0, wk, wv), 0.1)
    wk, wv = window(torch.float32)
    for bad_v, query in [(wv[:, :2], q), (wv.half(), q), (wv, torch.randn(9, 0, 64)),
                         (wv[:, :2], torch.randn(9, 2, 64))]:
        with pytest.raises(ValueError, match="do not match"):  # the kernel would read past them
            attend_parts(query, LayerParts(table, 0, wk, bad_v), 0.1)
    for slot in (3, 100_000_000, -1):  # three layers: no other slot lies in the records
        with pytest.raises(ValueError, match=f"layer slot {slot} of records of 3 layers"):
            attend_parts(q, LayerParts(table, slot, wk, wv), 0.1)


def test_parts_unlike_the_first_and_kept_tokens_past_the_parts_are_refused():
    """The kernel reads every part with the first one's shape and dtype, and ``keep`` as
    offsets into them: anything else would be read out of bounds."""
    g = torch.Generator().manual_seed(0)
    part = lambda heads=3, n=8, dtype=torch.float32, vn=None: KVBlock(
        torch.randn(2, heads, n, 16, generator=g).to(dtype),
        torch.randn(2, heads, n if vn is None else vn, 16, generator=g).to(dtype))
    for odd in (part(heads=2), part(dtype=torch.float16), part(vn=7)):
        with pytest.raises(ValueError, match="parts must all be 2 layers x 3 kv heads x head_dim 16"):
            scatter([part(), odd])
    block = scatter([part(), part(n=7)])
    for keep in (torch.tensor([0, 1, 15]), torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match="outside the 15 tokens of the parts"):
            group_table(block, keep)
    assert group_table(block, torch.tensor([0, 14])).tokens == 2


def test_a_delivery_counts_its_parts_tokens_and_bytes_once():
    block = scattered(torch.float16)
    assert block.tokens == sum(p.keys.shape[2] for p in block.parts) == 198
    assert block.nbytes == sum(p.nbytes for p in block.parts)
    assert block.table[:, 6].tolist() == [p.keys.shape[2] for p in block.parts]
    assert group_table(block, None).table is block.table  # every layer reads the one table


def test_no_parts_no_table():
    with pytest.raises(ValueError, match="no parts"):
        scatter([])


@needs_kernel
def test_the_parts_kernel_refuses_what_it_does_not_take():
    kernel = tierkv.kernels.decode_attend_parts
    q, out = torch.zeros(3, 3, 64), torch.zeros(3, 3, 64)
    with pytest.raises(ValueError, match="no kernel"):  # no parts and no window
        kernel(q.data_ptr(), 0.1, 0, 0, 0, 0, 0, 0, 0, 0, out.data_ptr(), 0, 0, 3, 3, 64, 0)
    table = torch.tensor([[0, 0, 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="part 0 has 0 tokens"):
        kernel(q.data_ptr(), 0.1, table.data_ptr(), 1, 0, 0, 0, 0, 0, 0, out.data_ptr(), 0, 0,
               3, 3, 64, 0)
    k, v = torch.zeros(3, 4, 64), torch.zeros(3, 4, 64)
    scores = torch.zeros(3, 3, 5)
    with pytest.raises(ValueError, match="the parts hold 4 tokens, the scores 5"):
        kernel(q.data_ptr(), 0.1, 0, 0, 0, k.data_ptr(), v.data_ptr(), 4 * 64 * 4, 4 * 64 * 4, 4,
               out.data_ptr(), scores.data_ptr(), 5, 3, 3, 64, 0)


def test_reads_in_place_only_where_the_kernel_runs(monkeypatch):
    ok = tierkv.kernels.decode_attend_parts is not None
    cpu = torch.device("cpu")
    assert reads_in_place(KVShape(30, 3, 64, torch.float32, 9), cpu) is ok
    assert reads_in_place(KVShape(30, 3, 64, torch.float16), cpu) is ok  # q_heads unset: MHA
    assert not reads_in_place(KVShape(30, 3, 64, torch.float32, 9), torch.device("cuda"))
    assert not reads_in_place(KVShape(30, 3, 60, torch.float32, 9), cpu)  # head_dim
    assert not reads_in_place(KVShape(30, 3, 64, torch.float32, 30), cpu)  # 10 heads a group
    monkeypatch.setattr(tierkv.kernels, "decode_attend_parts", None)
    assert not reads_in_place(KVShape(30, 3, 64, torch.float32, 9), cpu)


def test_an_unpacked_cpu_delivery_is_the_records_as_held(tmp_path):
    """``packed=False``: the group's blocks as the tiers hold them (host ones not copied),
    records read from disk decoded once, and the same tokens as the packed delivery."""
    from test_pipeline import filled_store, sync_reference

    store, keys = filled_store()
    with Pipeline(store, torch.device("cpu")) as pipe:
        for g in (0, 1):
            packed = pipe.submit(FetchPlan([(g, keys[g])])).wait(g)
            block = pipe.submit(FetchPlan([(g, keys[g])], packed=False)).wait(g)
            assert isinstance(block, Scattered) and len(block.parts) == len(keys[g])
            assert torch.equal(torch.cat([p.keys for p in block.parts], 2), packed.keys)
            assert torch.equal(torch.cat([p.values for p in block.parts], 2), packed.values)
            assert torch.equal(packed.keys, sync_reference(store, keys[g])[0])
            held = [i for i, key in enumerate(keys[g]) if key in store.host]
            assert held and all(block.parts[i].keys is store.host.get(keys[g][i]).keys for i in held)
            assert block.nbytes == packed.nbytes


@needs_kernel
def test_a_pass_verifying_drafted_tokens_attends_the_parts_as_their_packed_copy():
    """Several query tokens (drafted ones, the window's last) over the parts: each sees the
    records and the window up to its own token, as ``scored_decode_attention`` over the packed
    copy (and the same as one token at a time over the window cut after it)."""
    block = scattered(torch.float32)
    q = torch.randn(9, 4, 64, generator=torch.Generator().manual_seed(5))
    table = group_table(block, torch.arange(3, 40))
    wk, wv = window(torch.float32, w=7)
    parts = LayerParts(table, 1, wk, wv)
    want, want_probs = scored_decode_attention(q, *parts.packed(), 0.125)
    out, probs = attend_parts(q, parts, 0.125, scored=True)
    assert out.shape == (9, 4, 64) and probs.shape == (3, 12, parts.tokens)
    assert torch.allclose(out, want, atol=1e-5) and torch.allclose(probs, want_probs, atol=1e-6)
    assert torch.allclose(attend_parts(q, parts, 0.125), out, atol=1e-6)
    for i in range(4):  # token i: the window up to its own
        cut = LayerParts(table, 1, wk[:, :4 + i], wv[:, :4 + i])
        assert torch.allclose(attend_parts(q[:, i:i + 1], cut, 0.125), out[:, i:i + 1], atol=1e-5)
