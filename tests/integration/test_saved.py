"""Saved documents on the real model: save, reopen, what each holds, and who may write them."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from tierkv import ChunkConfig, DocInUseError, KVBlock, RecordKey, StorageError, TierConfig, TieredCache
from tierkv.hf import admit
from tierkv.hf.model import load_model
from tierkv.storage import DiskTier
from tierkv.textgen import city_fact, make_document, passkey_fact, passkey_prompt, question_turn
from tierkv.hf.model import cache_kwargs

from .common import LOGIT_ATOL, generate, saved_document

pytestmark = pytest.mark.integration


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
            model(ids, **cache_kwargs(model, cache), use_cache=True)
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
            model(ids, **cache_kwargs(model, cache), use_cache=True)
        assert cache.stats()["disk_bytes"] == 0  # everything is still on the host
        cache.save(tmp_path / "saved")
    with DiskTier(tmp_path / "saved") as disk:
        codecs = {disk.codec_of(key) for key in disk.keys()}
    assert codecs == {codec}


def test_a_new_cache_never_writes_over_a_saved_document(model_and_tok, tmp_path):
    """A saved directory used as a new cache's disk tier: a new document gets an id the
    directory does not hold (another process's counter starts at doc0 too), and naming the
    saved one is refused; the saved document still reopens whole."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 40, return_tensors="pt")["input_ids"]
    other = tok("Another text entirely. " * 30, return_tensors="pt")["input_ids"]
    small = dict(device_budget="8MB", host_budget="64MB")
    with TieredCache(model, TierConfig(**small), "full", doc="doc0") as cache, torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True)
        cache.save(tmp_path / "saved")
    config = TierConfig(**small, disk_dir=tmp_path / "saved")
    with pytest.raises(ValueError, match="already holds document 'doc0'.*TieredCache.open"):
        TieredCache(model, config, "full", doc="doc0")
    on_disk = TierConfig(device_budget="8MB", host_budget=0, disk_dir=tmp_path / "saved")
    with TieredCache(model, on_disk, "full") as cache, torch.no_grad():
        assert cache.doc != "doc0"
        model(other, **cache_kwargs(model, cache), use_cache=True)  # its records all go to disk
        unsaved = cache.doc
        assert unsaved in cache.store.disk.docs()
    with DiskTier(tmp_path / "saved") as disk:  # closed unsaved: no reopening would reach them
        assert unsaved not in disk.docs() and "doc0" in disk.saved_docs()
        key = RecordKey("crashed", 0, 0, 4)  # what a run that crashed before saving leaves
        disk.put(key, KVBlock(torch.zeros(1, 3, 4, 64), torch.zeros(1, 3, 4, 64)))
    with pytest.raises(ValueError, match="records of document 'crashed', never saved"):
        TieredCache(model, config, "full", doc="crashed")
    with TieredCache.open(model, tmp_path / "saved", doc="doc0") as reopened:
        assert torch.equal(reopened.token_ids, ids)
        assert reopened.get_seq_length() == ids.shape[1]
        with torch.no_grad():
            logits = model(ids[:, -1:], **cache_kwargs(model, reopened), use_cache=True).logits
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
        model(ids, **cache_kwargs(model, cache), use_cache=True)
        cache.save(tmp_path)
    with TieredCache(model, small, "full", doc="doc0") as cache, torch.no_grad():
        model(other, **cache_kwargs(model, cache), use_cache=True)
        with pytest.raises(ValueError, match="already holds another document 'doc0'"):
            cache.save(tmp_path)
    with TieredCache.open(model, tmp_path, small) as reopened:
        assert torch.equal(reopened.token_ids, ids)
        with torch.no_grad():
            more = tok(" And more.", return_tensors="pt")["input_ids"]
            model(more, **cache_kwargs(model, reopened), use_cache=True)
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
        model(ids, **cache_kwargs(model, cache), use_cache=True)
        cache.save(tmp_path / "doc")
        saved = {key for index in cache.indexes for key in index.keys}
    with TieredCache.open(model, tmp_path / "doc") as cache, torch.no_grad():
        before = model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True).logits
    more = tok(" What is the pass key?", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with TieredCache.open(model, tmp_path / "doc") as cache, torch.no_grad():
        out = model.generate(torch.cat([ids, more], 1), **cache_kwargs(model, cache), max_new_tokens=40,
                             min_new_tokens=40, do_sample=False)
        model.generate(torch.cat([out, more], 1), **cache_kwargs(model, cache), max_new_tokens=1,
                       do_sample=False)  # the new turn's prefill compacts the merged chunks
        live = {key for index in cache.indexes for key in index.keys}
        assert saved - live, "no saved record was rewritten: the test lost its point"
        cache.save(tmp_path / "copy")
    with TieredCache.open(model, tmp_path / "doc") as cache, torch.no_grad():
        assert torch.equal(cache.token_ids, ids)
        after = model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True).logits
    assert torch.equal(before, after)
    with DiskTier(tmp_path / "copy") as disk:
        assert set(disk.keys()) == live


def test_save_and_open_name_their_bad_arguments(model_and_tok, tmp_path):
    """A document fed as inputs_embeds has no token ids to save; open wants a TierConfig and
    a directory; save wants a path."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 20, return_tensors="pt")["input_ids"]
    config = TierConfig(device_budget="8MB", host_budget="8MB")
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        embeds = torch.nn.functional.embedding(ids, model.get_input_embeddings().weight)
        model(inputs_embeds=embeds, **cache_kwargs(model, cache), use_cache=True)
        with pytest.raises(ValueError, match=f"holds {ids.shape[1]} tokens but knows the ids of 0"):
            cache.save(tmp_path / "embeds")
    assert not (tmp_path / "embeds").exists()
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True)
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
    read = persist._read_meta

    def stale(disk, path, doc=None):
        doc, meta, arrays = read(disk, path, doc)
        return doc, meta, {**arrays, "token_ids": arrays["token_ids"].flip(0)}

    monkeypatch.setattr(persist, "_read_meta", stale)
    with pytest.raises(ValueError, match="changed while it was being opened"):
        TieredCache.open(model, tmp_path)
    monkeypatch.undo()
    with TieredCache.open(model, tmp_path) as cache:  # refused, it left nothing held
        assert torch.equal(cache.token_ids, ids)


def test_closing_on_a_full_disk_still_lets_the_document_go(model_and_tok, tmp_path, monkeypatch):
    """close() of a reopened document drops the records written since it opened; when the disk
    refuses even that, the error comes through, and the document is released all the same."""
    import os

    model, tok = model_and_tok
    ids, doc = saved_document(model, tok, tmp_path)
    config = TierConfig(device_budget="8MB", host_budget="100KB")
    cache = TieredCache.open(model, tmp_path, config)
    with torch.no_grad():
        model.generate(torch.cat([ids, ids[:, -8:]], 1), **cache_kwargs(model, cache), max_new_tokens=8,
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



def test_a_cache_that_fails_while_installing_gives_the_model_back(model_and_tok, monkeypatch):
    """A construction that fails after it switched the model's attention to its own (here: a
    hook cannot be registered) switches it back and registers nothing: the next cache works."""
    from transformers import AttentionInterface

    model, tok = model_and_tok
    before = set(AttentionInterface._global_mapping)

    def refused(*args, **kwargs):
        raise RuntimeError("no hooks today")

    monkeypatch.setattr(model, "register_forward_pre_hook", refused)
    with pytest.raises(RuntimeError, match="no hooks today"):
        TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full")
    monkeypatch.undo()
    assert model.config._attn_implementation == "sdpa"
    assert set(AttentionInterface._global_mapping) == before
    ids = tok("A short text. " * 10, return_tensors="pt")["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache:
        assert generate(model, ids, cache, new=2).numel() == 2

def test_reopening_a_document_again_and_again_does_not_grow_its_directory(model_and_tok, tmp_path):
    """Each turn over a reopened document writes records that close() drops; their space is
    reclaimed then, so the segments stay within twice the live records (``reclaim``)."""
    model, tok = model_and_tok
    ids, _ = saved_document(model, tok, tmp_path)
    config = TierConfig(device_budget="8MB", host_budget="100KB")
    for _ in range(3):
        with TieredCache.open(model, tmp_path, config) as cache, torch.no_grad():
            model.generate(torch.cat([ids, ids[:, -8:]], 1), **cache_kwargs(model, cache),
                           max_new_tokens=48, min_new_tokens=48)
    files = sum(p.stat().st_size for p in tmp_path.glob("seg-*.tkv"))
    with DiskTier(tmp_path) as disk:
        assert files <= 2 * disk.used, (files, disk.used)
