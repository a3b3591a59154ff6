"""TieredCache on the real model: exactness of the lossless path, budgets, retrieval, multi-turn."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from transformers import DynamicCache

from tierkv import ChunkConfig, DocInUseError, RecordKey, SelectConfig, StorageError, TierConfig, \
    TieredCache
from tierkv.hf import admit
from tierkv.hf.model import load_model
from tierkv.storage import DiskTier
from tierkv.textgen import city_fact, make_document, passkey_fact, passkey_prompt, question_turn

pytestmark = pytest.mark.integration

# Layer-wise prefill sums attention in query blocks, plain transformers in one pass: fp32
# rounding differs by a few ulps per layer, ~1e-5 relative on the logits after 30 layers.
LOGIT_ATOL = 1e-3


def saved_document(model, tok, path):
    """A short text prefilled through a ``full`` cache and saved under ``path``: (ids, doc)."""
    ids = tok("A short text. " * 40, return_tensors="pt")["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache, \
            torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        cache.save(path)
        return ids, cache.doc


def generate(model, ids, cache=None, new=8):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache)
    return out[0, ids.shape[1]:]


def test_prefill_logits_match_plain(model_and_tok, passkey_cases):
    model, _ = model_and_tok
    ids, _ = passkey_cases[0]
    with torch.no_grad():
        ref = model(ids).logits[0, -1]
        with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), "full",
                         prefill_block=128) as cache:
            got = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
    assert torch.allclose(got, ref, atol=LOGIT_ATOL), (got - ref).abs().max()
    assert got.argmax() == ref.argmax()


def test_full_through_disk_reproduces_greedy(model_and_tok, passkey_cases, tmp_path):
    model, _ = model_and_tok
    ids, _ = passkey_cases[1]
    ref = generate(model, ids, new=12)
    kv_bytes = 2 * 30 * 3 * 64 * 4 * ids.shape[1]
    budget = kv_bytes // 10
    config = TierConfig(device_budget=budget, host_budget=kv_bytes // 4, disk_dir=tmp_path)
    with TieredCache(model, config, "full") as cache:
        got = generate(model, ids, cache, new=12)
        stats = cache.stats()
        assert cache.store.device.peak <= budget
        assert cache.store.disk.used > 0, "part of the KV must have spilled to disk"
    assert torch.equal(got, ref), f"{got.tolist()} != {ref.tolist()}"
    assert stats["device_peak_bytes"] <= budget


# The target: 9/10 for every lossless policy. All five measure 10/10 here; quest and
# leoam (8-token pages, per-query-head criticality) also found 20 of 20 keys on seeds 10-29.
PASSKEY_FLOOR = {"tierkv": 9, "omnikv": 9, "full": 9, "quest": 9, "leoam": 9}


@pytest.mark.parametrize("policy", sorted(PASSKEY_FLOOR))
def test_passkey_retrieval(model_and_tok, passkey_cases, policy):
    model, tok = model_and_tok
    correct = 0
    for ids, answer in passkey_cases:
        with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), policy,
                         select=SelectConfig(budget=0.1)) as cache:
            correct += answer in tok.decode(generate(model, ids, cache, new=7))
    assert correct >= PASSKEY_FLOOR[policy], f"{policy}: {correct}/10"


@pytest.mark.parametrize("policy", ["tierkv", "full"])
def test_two_questions_on_one_cache(model_and_tok, policy, tmp_path):
    model, tok = model_and_tok
    rng = random.Random(7)
    facts = [passkey_fact(rng), city_fact(rng)]
    doc = make_document(tok, 900, 7, facts, depths=[0.3, 0.7])
    config = TierConfig(device_budget="8MB", host_budget="16MB", disk_dir=tmp_path)
    with TieredCache(model, config, policy) as cache:
        context = torch.zeros(1, 0, dtype=torch.long)
        for i, fact in enumerate(facts):
            intro = (f"There is {facts[0].hint} and {facts[1].hint} hidden in the text below. "
                     f"Find them and remember them.\n\n{doc}\n\n") if i == 0 else ""
            turn = question_turn(tok, intro + fact.question, fact.answer_prefix)
            new_ids = tok(turn, return_tensors="pt", add_special_tokens=False)["input_ids"]
            ids = torch.cat([context, new_ids], dim=1)
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
            assert fact.answer in tok.decode(out[0, ids.shape[1]:]), f"question {i}"
            context = out


def test_batch_and_close(model_and_tok):
    model, tok = model_and_tok
    before = model.config._attn_implementation
    cache = TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full")
    assert model.config._attn_implementation != before
    ids = tok(["one two three", "four five six"], return_tensors="pt")["input_ids"]
    with pytest.raises(ValueError, match="batch size 2"):
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
    cache.close()
    cache.close()
    assert model.config._attn_implementation == before


def test_sampling_runs(model_and_tok, passkey_cases):
    model, _ = model_and_tok
    ids, _ = passkey_cases[2]
    torch.manual_seed(0)
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), "tierkv") as cache:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=20, past_key_values=cache)
    assert out.shape[1] == ids.shape[1] + 5


def test_saved_document_answers_like_the_live_cache(model_and_tok, tmp_path):
    model, tok = model_and_tok
    rng = random.Random(11)
    facts = [passkey_fact(rng), city_fact(rng)]
    doc = make_document(tok, 700, 11, facts, depths=[0.3, 0.7])
    intro = (f"There is {facts[0].hint} and {facts[1].hint} hidden in the text below. "
             f"Find them and remember them.\n\n{doc}\n\n")
    first = tok(question_turn(tok, intro + facts[0].question, facts[0].answer_prefix),
                return_tensors="pt")["input_ids"]
    second = tok(question_turn(tok, facts[1].question, facts[1].answer_prefix),
                 return_tensors="pt", add_special_tokens=False)["input_ids"]
    config = TierConfig(device_budget="8MB", host_budget="8MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "tierkv") as cache:
        out = generate(model, first, cache, new=6)
        cache.save(tmp_path / "saved")
        ids = torch.cat([first, out.view(1, -1), second], dim=1)
        live = generate(model, ids, cache, new=6)
    with TieredCache.open(model, tmp_path / "saved") as reopened:
        assert reopened.get_seq_length() == first.shape[1] + out.numel() - 1
        assert torch.equal(reopened.token_ids, ids[:, :reopened.get_seq_length()])
        again = generate(model, ids, reopened, new=6)
    assert torch.equal(again, live)
    assert facts[1].answer in tok.decode(live)


def test_open_refuses_another_model_and_bad_dirs(model_and_tok, tmp_path, monkeypatch):
    model, tok = model_and_tok
    ids = tok("A short text. " * 40, return_tensors="pt")["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        cache.save(tmp_path / "saved")
    import tierkv.hf.persist as persist

    real = persist.model_identity
    monkeypatch.setattr(persist, "model_identity", lambda m: {**real(m), "fingerprint": 1})
    with pytest.raises(ValueError, match="another model"):
        TieredCache.open(model, tmp_path / "saved")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="does not exist"):
        TieredCache.open(model, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no saved document"):
        TieredCache.open(model, tmp_path / "empty")


@pytest.mark.parametrize("disk_bw, codec", [(100e9, "raw"), (1e6, "zstd")])
def test_save_writes_host_records_with_the_controllers_codec(model_and_tok, tmp_path, monkeypatch,
                                                            disk_bw, codec):
    """Records still on the host when a document is saved are written with the codec the
    store's controller picks for the disk, as spills are: raw on a fast disk, zstd on a slow one."""
    import tierkv.hf.cache as hf_cache
    from tierkv.storage.disk import DiskTier

    monkeypatch.setattr(hf_cache, "read_bandwidth", lambda path: disk_bw)
    model, tok = model_and_tok
    ids = tok("A short text about tiers. " * 40, return_tensors="pt")["input_ids"]
    config = TierConfig(device_budget="8MB", host_budget="256MB", disk_dir=tmp_path / "kv")
    with TieredCache(model, config, "tierkv") as cache:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        assert cache.stats()["disk_bytes"] == 0  # everything is still on the host
        cache.save(tmp_path / "saved")
    with DiskTier(tmp_path / "saved") as disk:
        codecs = {disk.codec_of(key) for key in disk.keys()}
    assert codecs == {codec}


@pytest.mark.parametrize("early", [True, False])
def test_dense_group_prefetch_starts_a_group_early_when_it_fits(model_and_tok, passkey_cases,
                                                                 monkeypatch, early):
    """With room on the device, a dense group's fetch starts when the group before it is
    delivered (hidden behind that whole group); without room, after that group, as before."""
    model, _ = model_and_tok
    ids, _ = passkey_cases[0]
    from tierkv.pipeline.fetcher import Pipeline

    issued = []  # (layer attending when a fetch was submitted, group)
    current = {"layer": None}
    real_submit, real_decode = Pipeline.submit, TieredCache._decode

    def submit(self, plan):
        issued.extend((current["layer"], fetch.group) for fetch in plan.groups)
        return real_submit(self, plan)

    def decode(self, layer, q, scaling):
        current["layer"] = layer
        return real_decode(self, layer, q, scaling)

    monkeypatch.setattr(Pipeline, "submit", submit)
    monkeypatch.setattr(TieredCache, "_decode", decode)
    if not early:  # as if the device tier had no room to spare
        monkeypatch.setattr(TieredCache, "_room", lambda self: 0)
    config = TierConfig(device_budget="64MB", host_budget="1GB")
    with TieredCache(model, config, "omnikv") as cache, torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        issued.clear()
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        filters = cache.policy.filters
        before = cache.groups[cache.group_of[filters[-1]] - 1]  # multi-layer group, then a filter
        dense_next = cache.group_of[filters[-1]]
        assert len(before) > 1 and cache.policy.dense(cache, filters[-1])
        layers = {layer for layer, group in issued if group == dense_next}
        assert layers == ({before[0]} if early else {before[-1]})


def test_split_leaves_attend_exactly_their_tokens(model_and_tok, passkey_cases, monkeypatch):
    """tierkv's trees split hot leaves below their 8-token records; with ``fetch_unit="leaf"``
    a fetch of such leaves keeps only their tokens of the records. Every layer attends keys equal to the plain model's
    at the prompt positions it names, and no selecting layer attends more than its budget."""
    from tierkv.hf.groups import GroupIndex

    model, _ = model_and_tok
    ids, _ = passkey_cases[3]
    prompt = ids.shape[1]
    with torch.no_grad():
        ref = DynamicCache()
        model(ids, past_key_values=ref, use_cache=True)
    trimmed, checked = [], []
    real_fetch = GroupIndex.fetch

    def fetch(self, leaves):
        spec = real_fetch(self, leaves)
        if spec.keep is not None:
            trimmed.append((spec.tokens, spec.positions.numel()))
        return spec

    monkeypatch.setattr(GroupIndex, "fetch", fetch)
    select = SelectConfig(budget=0.1, fetch_unit="leaf")
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), "tierkv",
                     select=select) as cache:
        attend = cache.policy.attend

        def spy(c, layer, q, k, v, positions, scaling):
            if q.shape[1] == 1:
                old = positions < prompt
                want = ref.layers[layer].keys[0][:, positions[old]]
                assert torch.allclose(k[:, old], want.to(k.dtype), atol=1e-3), layer
                if cache.policy.is_selecting(cache, layer):
                    assert positions.numel() <= select.tokens(cache.get_seq_length()), layer
                checked.append(layer)
            return attend(c, layer, q, k, v, positions, scaling)

        cache.policy.attend = spy
        with torch.no_grad():
            model.generate(ids, min_new_tokens=16, max_new_tokens=16, do_sample=False,
                           past_key_values=cache)
        leaves = [index.tree.sizes for index in cache.indexes]
    assert min(int(s.min()) for s in leaves) < 8, "no leaf split below its record"
    assert trimmed and all(kept < tokens for tokens, kept in trimmed)
    assert len(checked) >= 15 * 30


@pytest.mark.parametrize("policy", ["full", "streaming", "h2o", "razor", "quest", "leoam",
                                    "omnikv", "tierkv"])
def test_policies_keep_device_and_host_tensors_apart(model_and_tok, passkey_cases, monkeypatch,
                                                      policy):
    """On a GPU, q, k, v and attention's results are CUDA tensors while positions, trees and
    scores are CPU ones, and an operation mixing them raises. Here the tensors a policy gets
    from attention are marked as device tensors (``tests/devicesim.py``), so such a mix raises
    on the CPU too: through prefill, 12 decode steps (tree adaptation, leaf splits, filter-layer
    preselection on a device budget below four filter layers' KV) and a second turn."""
    from devicesim import OnDevice, to_device, to_host

    model, _ = model_and_tok
    ids = torch.cat([passkey_cases[0][0], passkey_cases[1][0]], dim=1)  # ~2K tokens
    for module in ("base", "streaming", "h2o", "razor"):  # the way up: mark, do not move
        monkeypatch.setattr(f"tierkv.policies.{module}.on_device", lambda t, like: to_device(t))
    calls = []
    with TieredCache(model, TierConfig(device_budget="10MB", host_budget="1GB"), policy,
                     select=SelectConfig(budget=0.1)) as cache:
        p = cache.policy
        attend, fetch, observe = p.attend, p.fetch, p.observe_prefill

        def on_attend(c, layer, q, k, v, positions, scaling):
            assert not isinstance(positions, OnDevice)
            calls.append("attend")
            return to_host(attend(c, layer, to_device(q), to_device(k), to_device(v), positions,
                                  scaling))

        def on_fetch(c, layer, q):
            wanted = fetch(c, layer, to_device(q))
            assert not isinstance(getattr(wanted, "positions", wanted), OnDevice), layer
            calls.append("fetch")
            return wanted

        def on_observe(c, layer, mass):
            calls.append("observe")
            return observe(c, layer, to_device(mass))

        p.attend, p.fetch, p.observe_prefill = on_attend, on_fetch, on_observe
        with torch.no_grad():
            out = model.generate(ids, min_new_tokens=12, max_new_tokens=12, do_sample=False,
                                 past_key_values=cache)
            more = torch.cat([out, out[:, -4:]], dim=1)
            model.generate(more, min_new_tokens=2, max_new_tokens=2, do_sample=False,
                           past_key_values=cache)
        if policy == "tierkv":  # the paths that cross most: preselection and leaf splits
            filters = [cache.group_of[f] for f in p.filters]
            assert any(p.preselects(cache, cache.groups[g][0]) for g in filters)
            assert min(int(index.tree.sizes.min()) for index in cache.indexes) < 8
    assert calls.count("attend") == 12 * 30  # 11 steps, then 1 after the second turn's prefill
    assert policy != "h2o" or "observe" in calls


def test_device_tier_follows_the_model(model_and_tok, monkeypatch):
    """``device="auto"`` puts the device tier where the model computes; a device tier elsewhere
    (attention would mix devices) and a model on a device TieredCache does not run on are
    refused before anything is stored."""
    model, _ = model_and_tok
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="8MB")) as cache:
        assert cache.device == torch.device("cpu")  # auto, with CUDA or not: the model is on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"the model is on cpu; the device tier must be"):
        TieredCache(model, TierConfig(device_budget="8MB", host_budget="8MB", device="cuda"))
    monkeypatch.undo()
    param = next(model.parameters())
    monkeypatch.setattr(type(model), "parameters",
                        lambda self, recurse=True: iter([param.to("meta")]))
    with pytest.raises(ValueError, match="the model is on meta"):
        TieredCache(model, TierConfig(device_budget="8MB", host_budget="8MB"))


def test_a_new_cache_never_writes_over_a_saved_document(model_and_tok, tmp_path):
    """A saved directory used as a new cache's disk tier: a new document gets an id the
    directory does not hold (another process's counter starts at doc0 too), and naming the
    saved one is refused; the saved document still reopens whole."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 40, return_tensors="pt")["input_ids"]
    other = tok("Another text entirely. " * 30, return_tensors="pt")["input_ids"]
    small = dict(device_budget="8MB", host_budget="64MB")
    with TieredCache(model, TierConfig(**small), "full", doc="doc0") as cache, torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        cache.save(tmp_path / "saved")
    config = TierConfig(**small, disk_dir=tmp_path / "saved")
    with pytest.raises(ValueError, match="already holds document 'doc0'.*TieredCache.open"):
        TieredCache(model, config, "full", doc="doc0")
    on_disk = TierConfig(device_budget="8MB", host_budget=0, disk_dir=tmp_path / "saved")
    with TieredCache(model, on_disk, "full") as cache, torch.no_grad():
        assert cache.doc != "doc0"
        model(other, past_key_values=cache, use_cache=True)  # its records all go to disk
        unsaved = cache.doc
    with pytest.raises(ValueError, match=f"records of document '{unsaved}', never saved"):
        TieredCache(model, config, "full", doc=unsaved)
    with TieredCache.open(model, tmp_path / "saved", doc="doc0") as reopened:
        assert torch.equal(reopened.token_ids, ids)
        assert reopened.get_seq_length() == ids.shape[1]
        with torch.no_grad():
            logits = model(ids[:, -1:], past_key_values=reopened, use_cache=True).logits
    with torch.no_grad():
        plain = model(torch.cat([ids, ids[:, -1:]], dim=1)).logits
    assert torch.allclose(logits[0, -1], plain[0, -1], atol=LOGIT_ATOL)


def test_new_documents_of_two_processes_get_distinct_names(tmp_path, make_block, monkeypatch):
    """Two processes' caches on one directory count docN from doc0 alike (``_ids``): a name
    another live cache holds is skipped, and so is one it wrote and let go of since this
    process read the directory; naming a held document is refused."""
    with DiskTier(tmp_path) as mine, DiskTier(tmp_path) as theirs:
        monkeypatch.setattr(admit, "_ids", itertools.count())
        assert admit.claim_doc(theirs, None, False) == "doc0"
        monkeypatch.setattr(admit, "_ids", itertools.count())
        assert admit.claim_doc(mine, None, False) == "doc1"
        with pytest.raises(DocInUseError, match="'doc0' is in use"):
            admit.claim_doc(mine, "doc0", True)
        key = RecordKey("doc2", 0, 0, 8)
        with DiskTier(tmp_path) as third:  # writes doc2 and closes, unseen by ``mine``
            third.hold_doc("doc2")
            third.put(key, make_block(key))
        assert "doc2" not in mine.docs()
        monkeypatch.setattr(admit, "_ids", itertools.count())
        assert admit.claim_doc(mine, None, False) == "doc3"


def test_a_saved_document_serves_one_live_cache_at_a_time(model_and_tok, tmp_path):
    """Reopening a document another live cache has open (here through a second model, as
    another process would) is refused before anything is written; once it closes, it opens."""
    model, tok = model_and_tok
    ids, doc = saved_document(model, tok, tmp_path)
    other, _ = load_model("smollm2-135m")
    first = TieredCache.open(model, tmp_path, doc=doc)
    try:
        with pytest.raises(DocInUseError, match=f"'{doc}' is in use by a live cache of process"):
            TieredCache.open(other, tmp_path, doc=doc)
        assert other.config._attn_implementation == "sdpa"  # the refused cache left no trace
    finally:
        first.close()
    with TieredCache.open(other, tmp_path, doc=doc) as second:
        assert torch.equal(second.token_ids, ids)


def test_save_never_replaces_another_document_of_the_same_id(model_and_tok, tmp_path):
    """Two caches of one id (``doc0`` in two processes' memory) saved to one directory: the
    second is refused and the first still reopens whole. Saving again where an earlier state of
    the same document lies replaces it, records the document no longer has included."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 40, return_tensors="pt")["input_ids"]
    other = tok("Another text entirely. " * 30, return_tensors="pt")["input_ids"]
    small = TierConfig(device_budget="8MB", host_budget="64MB")
    with TieredCache(model, small, "full", doc="doc0") as cache, torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        cache.save(tmp_path)
    with TieredCache(model, small, "full", doc="doc0") as cache, torch.no_grad():
        model(other, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="already holds another document 'doc0'"):
            cache.save(tmp_path)
    with TieredCache.open(model, tmp_path, small) as reopened:
        assert torch.equal(reopened.token_ids, ids)
        with torch.no_grad():
            more = tok(" And more.", return_tensors="pt")["input_ids"]
            model(more, past_key_values=reopened, use_cache=True)
        reopened.save(tmp_path / "copy")  # an earlier state of it there: replaced
        with DiskTier(tmp_path / "copy") as disk:
            disk.put(RecordKey("doc0", 0, 10**6, 10**6 + 8), reopened.store.get(
                reopened.indexes[0].keys[0]))  # a record the document does not have
        reopened.save(tmp_path / "copy")
        expected = {key for index in reopened.indexes for key in index.keys}
    with DiskTier(tmp_path / "copy") as disk:
        assert set(disk.keys()) == expected
    with TieredCache.open(model, tmp_path / "copy", small) as again:
        assert torch.equal(again.token_ids, torch.cat([ids, more], dim=1))


def test_a_reopened_document_outlives_the_turns_that_reshape_it(model_and_tok, tmp_path):
    """A saved document reopened, decoded until its chunk trees merge, then compacted by a new
    turn and saved elsewhere, and closed unsaved: its saved records were rewritten in the live
    cache, yet stay on disk, so it reopens as saved and answers as before; the copy saved
    elsewhere holds the reshaped state alone."""
    model, tok = model_and_tok
    prompt, _ = passkey_prompt(tok, 1000, 3)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    config = TierConfig(device_budget="8MB", host_budget="8MB", disk_dir=tmp_path / "doc")
    with TieredCache(model, config, "tierkv", chunks=ChunkConfig(merge_after=1, desert_threshold=0.9)
                     ) as cache, torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        cache.save(tmp_path / "doc")
        saved = {key for index in cache.indexes for key in index.keys}
    with TieredCache.open(model, tmp_path / "doc") as cache, torch.no_grad():
        before = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
    more = tok(" What is the pass key?", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with TieredCache.open(model, tmp_path / "doc") as cache, torch.no_grad():
        out = model.generate(torch.cat([ids, more], 1), past_key_values=cache, max_new_tokens=40, min_new_tokens=40,
                             do_sample=False)
        model.generate(torch.cat([out, more], 1), past_key_values=cache, max_new_tokens=1,
                       do_sample=False)  # the new turn's prefill compacts the merged chunks
        live = {key for index in cache.indexes for key in index.keys}
        assert saved - live, "no saved record was rewritten: the test lost its point"
        cache.save(tmp_path / "copy")
    with TieredCache.open(model, tmp_path / "doc") as cache, torch.no_grad():
        assert torch.equal(cache.token_ids, ids)
        after = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
    assert torch.equal(before, after)
    with DiskTier(tmp_path / "copy") as disk:
        assert set(disk.keys()) == live


def test_what_the_tiers_would_attend_wrongly_is_refused(model_and_tok):
    """Padding (zeros in attention_mask) and a context past a sliding window would be attended
    as plain tokens: refused before any layer runs, so the cache is as it was; a model whose
    attention does not go through AttentionInterface is refused up front."""
    from transformers import FalconConfig, FalconForCausalLM, Gemma2Config, Gemma2ForCausalLM, \
        MistralConfig, MistralForCausalLM

    model, tok = model_and_tok
    ids = tok("A short text. " * 20, return_tensors="pt")["input_ids"]
    config = TierConfig(device_budget="8MB", host_budget="8MB")
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        with pytest.raises(ValueError, match="attention_mask masks 3 of its"):
            model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)
        assert cache.get_seq_length() == 0 and cache.token_ids.numel() == 0
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                       max_new_tokens=2)
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(**tiny, sliding_window=16)).eval()
    with TieredCache(mistral, config, "full") as cache, torch.no_grad():
        mistral(torch.arange(10)[None], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"17 tokens pass the model's sliding window \(16\)"):
            mistral(torch.arange(7)[None], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 10
    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4)).eval()
    with pytest.raises(ValueError, match="FalconForCausalLM does not run its attention through"):
        TieredCache(falcon, config, "full")
    gemma = Gemma2ForCausalLM(Gemma2Config(**tiny, head_dim=8)).eval()
    with pytest.raises(ValueError, match=r"caps its attention logits \(attn_logit_softcapping=50"):
        TieredCache(gemma, config, "full")


def test_save_and_open_name_their_bad_arguments(model_and_tok, tmp_path):
    """A document fed as inputs_embeds has no token ids to save; open wants a TierConfig and
    a directory; save wants a path."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 20, return_tensors="pt")["input_ids"]
    config = TierConfig(device_budget="8MB", host_budget="8MB")
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        embeds = torch.nn.functional.embedding(ids, model.get_input_embeddings().weight)
        model(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=f"holds {ids.shape[1]} tokens but knows the ids of 0"):
            cache.save(tmp_path / "embeds")
    assert not (tmp_path / "embeds").exists()
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="save=5: expected a directory path"):
            cache.save(5)
        cache.save(tmp_path / "doc")
    with pytest.raises(ValueError, match="config=dict: expected a TierConfig"):
        TieredCache.open(model, tmp_path / "doc", {"device_budget": "8MB"})
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="'.*file' is not a directory"):
        TieredCache.open(model, tmp_path / "file")


def test_open_refuses_a_document_saved_over_while_it_opened(model_and_tok, tmp_path, monkeypatch):
    """What ``open`` read of a document before its cache held it is checked again once held:
    another process saving over it in between (here: the metadata read is made stale) is
    refused, not served as a mix of both."""
    from tierkv.hf import persist

    model, tok = model_and_tok
    ids, _ = saved_document(model, tok, tmp_path)
    read = persist.read_meta

    def stale(path, doc=None):
        doc, meta, arrays = read(path, doc)
        return doc, meta, {**arrays, "token_ids": arrays["token_ids"].flip(0)}

    monkeypatch.setattr(persist, "read_meta", stale)
    with pytest.raises(ValueError, match="changed while it was being opened"):
        TieredCache.open(model, tmp_path)
    monkeypatch.undo()
    with TieredCache.open(model, tmp_path) as cache:  # refused, it left nothing held
        assert torch.equal(cache.token_ids, ids)


def test_a_forward_that_fails_part_way_leaves_a_cache_that_says_so(model_and_tok, tmp_path,
                                                                 monkeypatch):
    """Ctrl-C in the middle of a step (or a full disk while sealing) leaves some layers with the
    step and others without: the cache refuses to go on or to be saved, naming what broke it,
    rather than attend wrongly; closing it still hands everything back, and the saved document
    it was reopened from is as it was saved."""
    model, tok = model_and_tok
    ids, _ = saved_document(model, tok, tmp_path)
    more = tok(" And again.", return_tensors="pt", add_special_tokens=False)["input_ids"]
    cache = TieredCache.open(model, tmp_path)
    calls, attend = [0], cache.policy.attend

    def interrupted(*args):
        calls[0] += 1
        if calls[0] == 40:  # layer 9 of the second decode step
            raise KeyboardInterrupt("injected")
        return attend(*args)

    monkeypatch.setattr(cache.policy, "attend", interrupted)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model.generate(torch.cat([ids, more], 1), past_key_values=cache, max_new_tokens=4)
    assert len({cache.layer_length(layer) for layer in range(cache.shape.layers)}) == 2
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"cannot go on: a forward pass failed "
                                                            r"part-way \(KeyboardInterrupt: injected\)"):
        model(cache.token_ids[:, -1:], past_key_values=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="cannot be saved"):
        cache.save(tmp_path / "copy")
    cache.close()
    assert model.config._attn_implementation == "sdpa"
    with TieredCache.open(model, tmp_path) as reopened, torch.no_grad():
        assert torch.equal(reopened.token_ids, ids)
        logits = model(ids[:, -1:], past_key_values=reopened, use_cache=True).logits
    with torch.no_grad():
        plain = model(torch.cat([ids, ids[:, -1:]], dim=1)).logits
    assert torch.allclose(logits[0, -1], plain[0, -1], atol=LOGIT_ATOL)


def test_closing_on_a_full_disk_still_lets_the_document_go(model_and_tok, tmp_path, monkeypatch):
    """close() of a reopened document drops the records written since it opened; when the disk
    refuses even that, the error comes through, and the document is released all the same."""
    import os

    model, tok = model_and_tok
    ids, doc = saved_document(model, tok, tmp_path)
    config = TierConfig(device_budget="8MB", host_budget="100KB")
    cache = TieredCache.open(model, tmp_path, config)
    with torch.no_grad():
        model.generate(torch.cat([ids, ids[:, -8:]], 1), past_key_values=cache, max_new_tokens=8,
                       min_new_tokens=8)
    assert set(cache.store.disk.keys()) - cache.snapshot, "nothing spilled: the test lost its point"

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(StorageError, match="No space left"):
        cache.close()
    monkeypatch.undo()
    assert not list(tmp_path.glob("tierkv.doc-*.lock"))
    with TieredCache.open(model, tmp_path, config) as again:
        assert again.doc == doc and torch.equal(again.token_ids, ids)


def test_a_cache_that_fails_to_build_lets_its_document_go(model_and_tok, tmp_path, monkeypatch):
    """A construction that fails after it claimed its document (here: the pipeline cannot
    start) releases it, and the tiers: the document opens again in this same process."""
    from tierkv.hf import cache as hf_cache

    model, tok = model_and_tok
    ids, doc = saved_document(model, tok, tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(hf_cache, "Pipeline", broken)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        TieredCache.open(model, tmp_path, doc=doc)
    monkeypatch.undo()
    assert not list(tmp_path.glob("tierkv.doc-*.lock"))
    assert model.config._attn_implementation == "sdpa"
    with TieredCache.open(model, tmp_path, doc=doc) as cache:
        assert torch.equal(cache.token_ids, ids)


def test_reopening_a_document_again_and_again_does_not_grow_its_directory(model_and_tok, tmp_path):
    """Each turn over a reopened document writes records that close() drops; their space is
    reclaimed then, so the segments stay within twice the live records (``reclaim``)."""
    model, tok = model_and_tok
    ids, _ = saved_document(model, tok, tmp_path)
    config = TierConfig(device_budget="8MB", host_budget="100KB")
    for _ in range(3):
        with TieredCache.open(model, tmp_path, config) as cache, torch.no_grad():
            model.generate(torch.cat([ids, ids[:, -8:]], 1), past_key_values=cache,
                           max_new_tokens=48, min_new_tokens=48)
    files = sum(p.stat().st_size for p in tmp_path.glob("seg-*.tkv"))
    with DiskTier(tmp_path) as disk:
        assert files <= 2 * disk.used, (files, disk.used)


@pytest.mark.parametrize("kwargs, message", [
    ({"config": {"device_budget": "8MB"}}, "config=dict: expected a TierConfig"),
    ({"select": {"budget": 0.1}}, "select=dict: expected a SelectConfig"),
    ({"chunks": {"min": 2}}, "chunks=dict: expected a ChunkConfig"),
    ({"prefill_block": True}, "prefill_block=True"),
    ({"doc": "../x"}, "doc"),
    ({"doc": 5}, "doc"),
])
def test_cache_arguments_of_the_wrong_kind(model_and_tok, kwargs, message):
    model, _ = model_and_tok
    with pytest.raises(ValueError, match=message):
        TieredCache(model, **kwargs)
    with pytest.raises(ValueError, match="expected a loaded transformers model"):
        TieredCache("smollm2-135m")


def test_a_device_budget_too_small_says_what_it_must_hold(model_and_tok):
    from tierkv.storage import TierFullError

    model, tok = model_and_tok
    ids = tok("A short text. " * 60, return_tensors="pt")["input_ids"]
    with TieredCache(model, TierConfig(device_budget="100KB", host_budget="64MB")) as cache:
        with pytest.raises(TierFullError, match=r"needs \d+ B, 100000 B free of 100000: .*whole "
                                                r"during prefill \(1536 B a token and layer\); "
                                                r"raise the device budget"):
            with torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True)
        assert "a smaller SelectConfig.budget, --budget, brings fewer" in cache._needs("fetch:0")


def test_continuing_without_the_cached_ids_is_named(model_and_tok):
    """generate feeds the model only the ids past what the cache holds: given only new ids,
    nothing would reach it, and given fewer ids than it holds, a tail of them would be fed again
    at the wrong positions; the error says what to pass, and the cache goes on."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 20, return_tensors="pt")["input_ids"]
    more = tok(" And more.", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache:
        generate(model, ids, cache, new=2)
        with pytest.raises(ValueError, match="pass cache.token_ids followed by the new tokens"):
            generate(model, more, cache, new=2)
        held = cache.get_seq_length()
        with pytest.raises(ValueError, match=f"new tokens would sit at position 1, but the cache "
                                             f"holds {held}: generate was given fewer ids"):
            generate(model, ids, cache, new=2)  # the first prompt again: part of it, re-fed
        assert cache.get_seq_length() == held
        again = generate(model, torch.cat([cache.token_ids, more], dim=1), cache, new=2)
    assert again.numel() == 2


def test_one_live_cache_per_model(model_and_tok):
    """A second TieredCache on a model a live one serves is refused (it would take over the
    model's attention, and closing either would hand it back under the other); once the first
    is closed, a new one is fine."""
    model, _ = model_and_tok
    config = TierConfig(device_budget="8MB", host_budget="8MB")
    first = TieredCache(model, config, "full")
    with pytest.raises(ValueError, match="already serves a live TieredCache"):
        TieredCache(model, config, "full")
    first.close()
    with TieredCache(model, config, "full") as second:
        assert model.config._attn_implementation == second._attn_name
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("policy, kwargs, message", [
    ("tierkv", {"profile": {"filter_layers": [12, 2, 17]}},
     r"profile=: filter_layers=\[12, 2, 17\]: must be strictly increasing layer indices in \[0, 29\)"),
    ("razor", {"profile": {"retrieval_heads": {"14": [7]}}},
     r"profile=: retrieval_heads\['14'\]=\[7\]: KV head out of range \[0, 3\): the profile does not fit"),
    ("razor", {"profile": {"retrieval_heads": [[14, 1]]}}, r"retrieval_heads=\[\[14, 1\]\]: expected a dict"),
    ("tierkv", {"profile": "abc"}, "profile=: expected a dict"),
    ("tierkv", {"select": SelectConfig(filter_layers=(2, 29))},
     r"filter_layers=\(2, 29\): layer 29 is at or past the model's last layer 29"),
])
def test_profiles_and_filter_layers_are_checked_against_the_model(model_and_tok, policy, kwargs, message):
    from tierkv.hf.profile import load_profile

    model, _ = model_and_tok
    assert load_profile(model)["filter_layers"] == [2, 12, 17]  # the shipped profile fits SmolLM2
    with pytest.raises(ValueError, match=message):
        TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), policy, **kwargs)
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), policy) as cache:
        assert cache.profile["filter_layers"] == [2, 12, 17]  # the model serves a cache again
