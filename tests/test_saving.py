"""Saving and reopening on tiny random Llamas: a save that fails part-way (a full disk, Ctrl-C)
leaves what was stored as it was (the saved state reopens, a new directory keeps nothing of the
failed save), a save that could only break the stored document is refused before it writes,
saving again writes only what is new, and a reopening that would fail at its first seal is
refused at once."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from tierkv import TierConfig, TieredCache
from tierkv.hf.model import cache_kwargs
from tierkv.hf.profile import load_profile, save_profile
from tierkv.storage.disk import DiskTier
from tierkv.storage.diskmeta import DocMeta

from tinyllama import ids, tiny

FULL = OSError(28, "No space left on device")


def prefilled(model, config, policy="full", **kwargs) -> TieredCache:
    cache = TieredCache(model, config, policy, **kwargs)
    with torch.no_grad():
        model(ids(300, seed=1), **cache_kwargs(model, cache), use_cache=True)
    return cache


def failing_once(monkeypatch, cls, name, after: int = 0):
    """Make ``cls.name`` raise ``FULL`` on its call number ``after + 1``, then work again."""
    real, calls = getattr(cls, name), [0]

    def fail(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise FULL
        return real(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, fail)


def test_a_save_cut_short_leaves_a_new_directory_empty_and_can_be_retried(tmp_path, monkeypatch):
    model, where = tiny(), tmp_path / "saved"
    with prefilled(model, TierConfig(device_budget="1MB", host_budget="64MB")) as cache:
        failing_once(monkeypatch, DiskTier, "put", after=9)
        with pytest.raises(OSError, match="No space"):
            cache.save(where)
        with DiskTier(where) as disk:  # before: 9 records of a document never saved, which
            assert disk.keys() == [] and disk.docs() == []  # refused the retry below
        cache.save(where)
    with TieredCache.open(model, where) as reopened:
        assert reopened.get_seq_length() == 300


@pytest.mark.parametrize("cut", ["manifest", "clean-up"])
def test_an_in_place_save_cut_short_keeps_a_whole_document(tmp_path, monkeypatch, cut):
    """A reopened document saved again in its own directory after 40 more tokens: cut short
    before its manifest is written, the saved state stays; cut short after (the records of the
    replaced state being removed), the new one does. Before, close() removed the records the
    written (or still pending) metadata listed: the document no longer opened."""
    model, where = tiny(), tmp_path / "doc"
    config = TierConfig(device_budget="1MB", host_budget="16KB", disk_dir=where)
    with prefilled(model, config) as cache:
        cache.save(where)
    with TieredCache.open(model, where, TierConfig(device_budget="1MB", host_budget="16KB")) as cache:
        with torch.no_grad():
            model(ids(40, seed=3), **cache_kwargs(model, cache), use_cache=True)
        if cut == "manifest":
            failing_once(monkeypatch, DocMeta, "save")
        else:
            failing_once(monkeypatch, DiskTier, "remove_many")
        with pytest.raises(OSError, match="No space"):
            cache.save(where)
        monkeypatch.undo()
    with TieredCache.open(model, where) as reopened:
        assert reopened.get_seq_length() == (300 if cut == "manifest" else 340)
        with torch.no_grad():
            model(ids(3, seed=4), **cache_kwargs(model, reopened), use_cache=True)  # records read


def test_a_save_whose_fsync_failed_rewrites_that_segment_and_reopens(tmp_path, monkeypatch):
    """An fsync of a segment fails as the document is saved in place: the save raises, the next
    one copies that segment's records to a fresh segment instead of trusting a second fsync of
    it, and the document reopens and goes on as the live cache does."""
    import errno
    import os

    from tierkv.storage.manifest import DiskWriteError

    model, where = tiny(), tmp_path / "doc"
    config = TierConfig(device_budget="1MB", host_budget="16KB", disk_dir=where)
    real, failed = os.fsync, []

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith("seg-") and not failed:
            failed.append(name)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)
    more = ids(3, seed=4)
    with prefilled(model, config) as cache:
        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(DiskWriteError, match="fsync"):
            cache.save(where)
        cache.save(where)
        monkeypatch.undo()
        assert failed and not (where / failed[0]).exists()
        with torch.no_grad():
            live = model(more, **cache_kwargs(model, cache), use_cache=True).logits
    with TieredCache.open(model, where) as reopened, torch.no_grad():
        assert reopened.get_seq_length() == 300
        again = model(more, **cache_kwargs(model, reopened), use_cache=True).logits
    assert torch.equal(live, again)


def test_an_earlier_state_with_other_layer_groups_is_not_replaced(tmp_path):
    """The same text saved under the same id by a policy that groups layers otherwise: its
    records' keys would name other layers' KV, so a save cut short would leave the stored one
    unreadable. Refused before anything is written; the stored document still answers."""
    model, where = tiny(layers=6), tmp_path / "saved"
    config = TierConfig(device_budget="1MB", host_budget="64MB")
    with prefilled(model, config, "full", doc="report") as cache:
        cache.save(where)
    with prefilled(model, config, "tierkv", doc="report") as cache:
        with pytest.raises(ValueError, match="other layer groups .*'full'.*'tierkv'"):
            cache.save(where)
    with TieredCache.open(model, where) as reopened, torch.no_grad():
        assert reopened.policy.name == "full"
        model(ids(3, seed=4), **cache_kwargs(model, reopened), use_cache=True)


def test_a_profile_a_document_cannot_carry_is_refused_before_anything_is_written(tmp_path):
    model = tiny(layers=6)
    profile = {"filter_layers": [2, 4], "similarity": np.float32(0.93)}
    with pytest.raises(ValueError, match=r"profile=: not JSON .*float32"):
        TieredCache(model, TierConfig(device_budget="1MB", disk_dir=tmp_path), "omnikv",
                    profile=profile)
    assert not any(tmp_path.glob("seg-*"))


def test_a_profile_written_over_survives_a_write_cut_short(tmp_path, monkeypatch):
    model = tiny(layers=6)
    save_profile({"model": "tiny", "filter_layers": [2, 4]}, "tiny", tmp_path)

    def torn(self, text, *args, **kwargs):  # the disk fills half-way through the file
        with open(self, "w") as out:
            out.write(text[: len(text) // 2])
        raise FULL
    monkeypatch.setattr(pathlib.Path, "write_text", torn)
    with pytest.raises(OSError, match="No space"):
        save_profile({"model": "tiny", "filter_layers": [2, 3]}, "tiny", tmp_path)
    monkeypatch.undo()
    assert load_profile(model, tmp_path)["filter_layers"] == [2, 4]
    assert json.loads((tmp_path / "tiny.json").read_text())["filter_layers"] == [2, 4]


@pytest.mark.parametrize("in_place", [False, True])
def test_saving_again_and_again_writes_only_what_is_new(tmp_path, in_place):
    """A document saved after every turn: before, every save wrote every record again, and the
    directory grew by a whole document a save (6x after six)."""
    model, where = tiny(), tmp_path / "saved"
    config = TierConfig(device_budget="4MB", host_budget="64MB",
                        disk_dir=where if in_place else None)
    with prefilled(model, config) as cache, torch.no_grad():
        for turn in range(4):
            cache.save(where)
            model(ids(8, seed=10 + turn), **cache_kwargs(model, cache), use_cache=True)
        cache.save(where)
        with DiskTier(where) as disk:
            live = disk.used
    segments = sum(path.stat().st_size for path in where.glob("seg-*.tkv"))
    assert segments < 1.1 * live, (segments, live)
    with TieredCache.open(model, where) as reopened:
        assert reopened.get_seq_length() == 332


def test_a_disk_budget_the_directory_exceeds_is_refused_when_opening(tmp_path):
    model, where = tiny(), tmp_path / "saved"
    with prefilled(model, TierConfig(device_budget="1MB")) as cache:
        cache.save(where)
    with pytest.raises(ValueError, match=r"holds \d+ B of records, more than the disk budget "
                                         r"of 10000 B"):
        TieredCache.open(model, where, TierConfig(device_budget="1MB", disk_budget=10_000))
    with TieredCache.open(model, where) as reopened:  # and it still opens as it was
        assert reopened.get_seq_length() == 300


@pytest.mark.parametrize("policy, selector", [("h2o", "last"), ("omnikv", "uniform"),
                                              ("tierkv", "exp"), ("tierkv", "last")])
def test_a_reopened_document_goes_on_as_the_live_cache(tmp_path, policy, selector):
    """What a policy built up while decoding is saved with the document (``Policy.state``):
    h2o's accumulated attention and evictions, the selectors' running scores, tierkv's last
    queries and candidates. Before, a reopened document forgot them and went on otherwise
    (logits up to 0.58 apart for h2o, 0.51 for omnikv with the uniform selector)."""
    from tierkv import SelectConfig

    model = tiny(layers=8)
    budgets = {"device_budget": "400KB", "host_budget": "128KB"}
    select = SelectConfig(budget=96, selector=selector)
    prompt, more = ids(1000, seed=1), ids(20, seed=2)

    def go_on(cache, tokens):
        return model.generate(tokens, **cache_kwargs(model, cache), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
    config = TierConfig(**budgets, disk_dir=tmp_path / "kv")
    with TieredCache(model, config, policy, select=select) as cache, torch.no_grad():
        out = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=12,
                             min_new_tokens=12, do_sample=False)
        cache.save(tmp_path / "saved")
        tokens = torch.cat([out, more], dim=1)
        live = go_on(cache, tokens)
        if policy == "tierkv" and selector == "last":
            assert cache.policy.preselects(cache, 0)  # its candidates are part of its state
    with TieredCache.open(model, tmp_path / "saved", TierConfig(**budgets)) as reopened, \
            torch.no_grad():
        again = go_on(reopened, tokens)
    assert torch.equal(live.sequences, again.sequences)
    for a, b in zip(live.scores, again.scores):
        assert torch.equal(a, b)


KILLED_RUN = """
import os, sys, torch
from tierkv import TierConfig, TieredCache
from tierkv.hf.model import cache_kwargs
from tinyllama import ids, tiny
model = tiny()
cache = TieredCache.open(model, sys.argv[1], TierConfig(device_budget="1MB", host_budget="1KB"))
with torch.no_grad():
    model(ids(120, seed=3), **cache_kwargs(model, cache), use_cache=True)
os._exit(0)  # killed: its records past the saved state stay in the directory, listed nowhere
"""


def test_a_killed_runs_records_are_never_taken_for_the_saved_states(tmp_path):
    """A reopened document continued by a process that died leaves records of its id past the
    saved state. A later cache of the document going on with other tokens seals records of
    the same bounds; its save must write them over the dead run's (a save that skipped every
    key the directory held listed the dead run's KV: the reopened document then answered
    otherwise than the live cache)."""
    import os
    import subprocess
    import sys

    model, where = tiny(), tmp_path / "doc"
    with prefilled(model, TierConfig(device_budget="1MB", host_budget="16KB", disk_dir=where)) as c:
        c.save(where)
    tests = os.path.dirname(__file__)
    subprocess.run([sys.executable, "-c", KILLED_RUN, str(where)], check=True, cwd=tests,
                   env={**os.environ, "PYTHONPATH": tests})
    with DiskTier(where) as disk:
        assert any(key.end > 300 for key in disk.keys())  # the dead run's records
    cache = TieredCache.open(model, where, TierConfig(device_budget="1MB", host_budget="64MB"))
    with torch.no_grad():
        model(ids(120, seed=5), **cache_kwargs(model, cache), use_cache=True)
        cache.save(where)
        live = model(ids(3, seed=4), **cache_kwargs(model, cache), use_cache=True).logits
    cache.close()
    with TieredCache.open(model, where) as reopened, torch.no_grad():
        again = model(ids(3, seed=4), **cache_kwargs(model, reopened), use_cache=True).logits
    assert torch.equal(live, again)
