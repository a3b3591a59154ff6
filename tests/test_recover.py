"""A forward pass that fails part-way, and Ctrl-C during one, on tiny random Llamas: the cache is
put back as it was before the pass, what it sealed taken back out (``tierkv.hf.recover``), and
goes on as a cache that never saw the pass; where it cannot be (a second Ctrl-C), it refuses to
go on."""
from __future__ import annotations

import contextlib
import signal

import pytest
import torch

from tierkv import TierConfig, TieredCache
from tierkv.hf.model import cache_kwargs
from tierkv.policies import REGISTRY
from tierkv.storage.base import TierFullError
from tinyllama import ids, tiny

TIERS = dict(device_budget="8MB", host_budget="8MB")


def step(model, cache, token):
    return model(token, **cache_kwargs(model, cache), use_cache=True).logits[0, -1]


def held(cache):
    """What the cache holds: its ids and every layer's length."""
    return cache.token_ids.clone(), [cache.layer_length(i) for i in range(cache.shape.layers)]


@contextlib.contextmanager
def twins(prompt: int = 50, policy: str = "full", tmp_path=None, **tiers):
    """Caches of ``policy`` on two copies of one tiny model, both fed ``prompt`` tokens (with a
    disk tier each under ``tmp_path`` when given; ``tiers`` replace ``TIERS``): (model, cache,
    other model, plain cache), the first to fail, the second never."""
    model, other = tiny(layers=6), tiny(layers=6)
    configs = [TierConfig(**{**TIERS, **tiers},
                          disk_dir=None if tmp_path is None else tmp_path / name)
               for name in ("failing", "plain")]
    profile = {"retrieval_heads": {"1": [0]}} if policy == "razor" else None
    with TieredCache(model, configs[0], policy, profile=profile) as cache, \
            TieredCache(other, configs[1], policy, profile=profile) as plain, torch.no_grad():
        if prompt:
            step(model, cache, ids(prompt))
            step(other, plain, ids(prompt))
        yield model, cache, other, plain


class Fail:
    """Make the next forward pass fail at ``layer`` (past the last: after it, in the final
    norm; in the attention, modulo the layers), in one of the ways a pass stops."""

    def __init__(self, model, cache, layer: int, how: str):
        self.model, self.cache, self.how = model, cache, how
        if how == "error in the attention":  # raised inside the cache's own code
            real, layer = cache._attend, layer % len(model.model.layers)

            def attend(module, query, scaling):
                if module.layer_idx == layer:
                    raise ValueError("attention broke")
                return real(module, query, scaling)
            self.undo = lambda: vars(cache).pop("_attend")
            cache._attend = attend
        else:  # before the layer, or after the last one (the model's final norm)
            layers = model.model.layers
            where = layers[layer] if layer < len(layers) else model.model.norm
            self.undo = where.register_forward_pre_hook(self.hook).remove

    def hook(self, module, args):
        if self.how == "error in a layer":
            raise RuntimeError("layer broke")
        if self.how == "ctrl-c and an error":
            signal.raise_signal(signal.SIGINT)
            raise RuntimeError("layer broke")
        if self.how == "interrupt outside the cache":  # another handler's, not held
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)  # Ctrl-C
        if self.how == "ctrl-c twice":
            signal.raise_signal(signal.SIGINT)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


FAILURES = ["error in a layer", "error in the attention", "interrupt outside the cache"]


@pytest.mark.parametrize("how", FAILURES)
def test_a_decode_step_that_fails_part_way_is_undone(how):
    """A decode step stopped at each of the layers in turn, and after the last (over 16 steps,
    so groups seal older tokens in some of them): the cache holds what it held before, and the
    step run again gives the logits of a cache that never failed."""
    with twins() as (model, cache, other, plain):
        for n in range(16):
            token = ids(1, seed=100 + n)
            before = held(cache)
            error = KeyboardInterrupt if how.startswith("interrupt") else Exception
            with Fail(model, cache, n % 7, how), pytest.raises(error):
                step(model, cache, token)
            # (after an interrupt outside the cache, the undo waits for its next use)
            got = step(model, cache, token)
            assert torch.equal(held(cache)[0][:, :-1], before[0])
            torch.testing.assert_close(got, step(other, plain, token), rtol=1e-6, atol=1e-6)
            assert held(cache)[1] == held(plain)[1]


@pytest.mark.parametrize("how", ["error in a layer", "error in the attention"])
def test_what_a_failed_pass_leaves_is_what_was_there_before(how):
    """Right after the exception: the ids, every layer's length, the device tier's use and the
    steps counted are as before the pass; autograd's mode is back."""
    model = tiny(layers=6)
    with TieredCache(model, TierConfig(**TIERS), "tierkv") as cache:
        step(model, cache, ids(300))
        for n in range(3):
            step(model, cache, ids(1, seed=10 + n))
        before, used, steps = held(cache), cache.store.device.used, cache.steps
        with Fail(model, cache, 4, how), pytest.raises(Exception, match="broke"):
            step(model, cache, ids(1, seed=20))
        after = held(cache)
        assert torch.equal(after[0], before[0]) and after[1] == before[1]
        assert cache.store.device.used <= used and cache.steps == steps
        assert torch.is_grad_enabled() and not cache._step
        step(model, cache, ids(1, seed=20))
        assert cache.get_seq_length() == 304


def test_ctrl_c_lets_a_decode_step_end_and_stops_a_prompt_between_layers():
    """Ctrl-C during a decode step: the step ends (the cache holds its token), then
    KeyboardInterrupt. During a prompt: it stops as its next layer attends, and the prompt is
    undone; run again, both give a never-interrupted cache's logits. Python's own SIGINT
    handler is back after each pass."""
    with twins() as (model, cache, other, plain):
        with Fail(model, cache, 3, "ctrl-c"), pytest.raises(KeyboardInterrupt):
            step(model, cache, ids(1, seed=7))
        assert cache.get_seq_length() == 51 and cache.token_ids.shape[1] == 51
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        step(other, plain, ids(1, seed=7))
        question = ids(20, seed=8)  # a prompt within the recent window: none of it sealed
        for layer in range(6):
            with Fail(model, cache, layer, "ctrl-c"), pytest.raises(KeyboardInterrupt):
                step(model, cache, question)
            assert [cache.layer_length(i) for i in range(6)] == [51] * 6
            assert cache.token_ids.shape[1] == 51
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        torch.testing.assert_close(step(model, cache, question), step(other, plain, question),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(step(model, cache, ids(1, seed=9)),
                                   step(other, plain, ids(1, seed=9)), rtol=1e-6, atol=1e-6)


def test_ctrl_c_twice_stops_at_once_and_the_cache_refuses_to_go_on():
    model = tiny(layers=6)
    with TieredCache(model, TierConfig(**TIERS), "full") as cache, torch.no_grad():
        step(model, cache, ids(50))
        with Fail(model, cache, 3, "ctrl-c twice"), pytest.raises(KeyboardInterrupt):
            step(model, cache, ids(1, seed=7))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(RuntimeError, match=r"failed part-way \(KeyboardInterrupt: Ctrl-C "
                                               r"twice"):
            step(model, cache, ids(1, seed=7))
        with pytest.raises(RuntimeError, match="cannot be saved"):
            cache.save(cache.config.disk_dir or "unused")


def test_an_application_s_own_sigint_handler_is_left_alone():
    """Under a handler of the application's, a SIGINT is its to handle: the cache does not hold
    it, and leaves the handler installed."""
    model = tiny(layers=4)
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, mine)
    try:
        with TieredCache(model, TierConfig(**TIERS), "full") as cache, torch.no_grad():
            step(model, cache, ids(30))
            with Fail(model, cache, 2, "ctrl-c"):
                step(model, cache, ids(1, seed=3))
            assert seen == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is mine
            assert cache.get_seq_length() == 31
    finally:
        signal.signal(signal.SIGINT, previous)


def same_chunks(cache, states):
    """Whether each group's chunk tree holds ``states`` (``GroupIndex.state()`` of each)."""
    return all(set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
               for a, b in zip((index.state() for index in cache.indexes), states))


@pytest.mark.parametrize("how", ["error in a layer", "ctrl-c"])
@pytest.mark.parametrize("policy, disk", [("full", False), ("full", True), ("tierkv", True)])
def test_a_long_prompt_stopped_after_its_groups_sealed_is_undone(tmp_path, policy, disk, how):
    """A prompt longer than the recent window seals its tokens group by group. Stopped at a
    later layer, the chunks and records it added are taken out, the tokens that were in the
    windows go back, and each group's chunk tree is as before; run again, the prompt and the
    steps after it give a never-failed cache's logits."""
    with twins(300, policy, tmp_path if disk else None) as (model, cache, other, plain):
        for n in range(3):
            for m, c in ((model, cache), (other, plain)):
                step(m, c, ids(1, seed=n))
        before, states, stored = held(cache), [index.state() for index in cache.indexes], \
            records_stored(cache)
        windows = [cache.store.device.reserved_for(f"window:{layer}") for layer in range(6)]
        prompt = ids(100, seed=5)
        with Fail(model, cache, 4, how), pytest.raises(BaseException):
            step(model, cache, prompt)
        assert held(cache)[1] == before[1] and torch.equal(held(cache)[0], before[0])
        assert same_chunks(cache, states) and records_stored(cache) == stored
        assert [cache.store.device.reserved_for(f"window:{layer}") for layer in range(6)] == \
            windows  # (no prompt-sized window left behind)
        torch.testing.assert_close(step(model, cache, prompt), step(other, plain, prompt),
                                   rtol=1e-6, atol=1e-6)
        for n in range(3):
            torch.testing.assert_close(step(model, cache, ids(1, seed=9 + n)),
                                       step(other, plain, ids(1, seed=9 + n)), rtol=1e-6, atol=1e-6)


def test_a_first_prompt_stopped_part_way_leaves_an_empty_cache(tmp_path):
    with twins(0, "tierkv", tmp_path) as (model, cache, other, plain):
        with Fail(model, cache, 4, "ctrl-c"), pytest.raises(KeyboardInterrupt):
            step(model, cache, ids(300))
        assert cache.get_seq_length() == 0 and cache.token_ids.shape[1] == 0
        assert records_stored(cache) == 0
        torch.testing.assert_close(step(model, cache, ids(300)), step(other, plain, ids(300)),
                                   rtol=1e-6, atol=1e-6)


def records_stored(cache):
    stats = cache.store.stats()  # (the device tier holds copies of some)
    return stats["host_records"] + stats.get("disk_records", 0)


def full_disk_at_third_put(monkeypatch, cache) -> list[int]:
    """Make ``cache.store.put`` raise ENOSPC on its third call; the calls counted so far."""
    real, calls = cache.store.put, [0]

    def put(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.store, "put", put)
    return calls


@pytest.mark.parametrize("tokens", [1, 100])
def test_a_store_that_fails_while_sealing_is_undone(monkeypatch, tokens):
    """A full disk as a decode step seals (or as a prompt, on a cache with no disk tier, seals
    its first layer group): the records it stored are removed, none is in the index, and the
    pass is undone (what the groups before it sealed taken back out); with room again, the same
    pass gives a never-failed cache's logits."""
    with twins(40) as (model, cache, other, plain):
        for c, m in ((cache, model), (plain, other)):
            for n in range(7):
                step(m, c, ids(1, seed=n))
        real, calls = cache.store.put, full_disk_at_third_put(monkeypatch, cache)
        before, stored = held(cache), records_stored(cache)
        states = [index.state() for index in cache.indexes]
        token = ids(tokens, seed=50)  # the window's 32 + 8 tokens: a step seals 8 in each group
        with pytest.raises(OSError):
            step(model, cache, token)
        assert calls[0] == 3  # (the pass's first two groups had sealed: taken back out too)
        assert records_stored(cache) == stored and same_chunks(cache, states)
        assert held(cache)[1] == before[1] and torch.equal(held(cache)[0], before[0])
        monkeypatch.setattr(cache.store, "put", real)
        torch.testing.assert_close(step(model, cache, token), step(other, plain, token),
                                   rtol=1e-6, atol=1e-6)
        assert held(cache)[1] == held(plain)[1]
        assert records_stored(cache) == sum(len(index.keys) for index in cache.indexes)


def test_a_prompt_whose_records_fail_to_store_is_undone(tmp_path, monkeypatch):
    """With a disk tier a prompt's records are ranked by its index's new chunks, so the index
    names them before they are stored: a full disk then takes them back out of the index, and
    the prompt is undone."""
    with twins(50, "full", tmp_path) as (model, cache, other, plain):
        real = cache.store.put
        full_disk_at_third_put(monkeypatch, cache)
        before, states = held(cache), [index.state() for index in cache.indexes]
        with pytest.raises(OSError):
            step(model, cache, ids(100, seed=5))
        assert held(cache)[1] == before[1] and same_chunks(cache, states)
        monkeypatch.setattr(cache.store, "put", real)
        torch.testing.assert_close(step(model, cache, ids(100, seed=5)),
                                   step(other, plain, ids(100, seed=5)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_every_policy_goes_on_after_failed_passes_as_if_they_never_ran(tmp_path, policy):
    """Every policy, a small device tier and a disk tier: decode steps, a question and a prompt
    longer than the window, each first stopped at some layer (an error before a layer or in the
    attention, Ctrl-C), then run: the ids, lengths and device bytes held for the windows of a
    cache that never failed, and, but for the adaptive trees of ``leoam`` and ``tierkv`` (what
    a failed pass's attention taught them is kept), its logits and chunk trees (what the
    policies learned in failed passes is undone: ``h2o``'s evictions, the selectors' scores)."""
    with twins(400, policy, tmp_path, device_budget="1MB") as (model, cache, other, plain):
        adaptive = cache.policy.adaptive
        for n in range(15):
            token = ids({8: 12, 13: 80}.get(n, 1), seed=30 + n)
            how = ["error in a layer", "error in the attention", "ctrl-c"][n % 3]
            with Fail(model, cache, (n * 5) % 7, how), pytest.raises(BaseException):
                step(model, cache, token)
            if how == "ctrl-c" and token.shape[1] == 1:  # the step ended before the interrupt
                step(other, plain, token)
            else:
                got, want = step(model, cache, token), step(other, plain, token)
                if adaptive:  # what a failed pass's attention taught its trees is kept
                    assert torch.isfinite(got).all()
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            assert held(cache)[1] == held(plain)[1] and torch.equal(held(cache)[0], held(plain)[0])
            assert [cache.store.device.reserved_for(f"window:{layer}") for layer in range(6)] == \
                [plain.store.device.reserved_for(f"window:{layer}") for layer in range(6)]
            assert adaptive or same_chunks(cache, [index.state() for index in plain.indexes])
        assert cache.store.device.peak <= cache.store.device.budget


def test_an_interrupt_that_skips_the_model_s_hooks_is_undone_at_the_next_use():
    """A KeyboardInterrupt not held (raised by code, or by an application's handler) skips the
    model's forward hook: a Ctrl-C after it is not held (the pass is over), autograd's mode and
    the SIGINT handler come back at the cache's next use, and ``generate`` given the ids the
    cache reports then goes on as a cache that never failed."""
    with twins() as (model, cache, other, plain):
        with torch.enable_grad():
            with Fail(model, cache, 3, "interrupt outside the cache"), \
                    pytest.raises(KeyboardInterrupt):
                step(model, cache, ids(20, seed=3))
            with pytest.raises(KeyboardInterrupt):  # at once: no pass is under way
                signal.raise_signal(signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            more = torch.cat([cache.token_ids, ids(4, seed=4)], dim=1)  # (still the pass's ids)
            got = model.generate(more, **cache_kwargs(model, cache), max_new_tokens=5,
                                 do_sample=False)
            assert torch.is_grad_enabled()
        step(other, plain, more[:, 50:])
        assert torch.equal(got[0, :more.shape[1]], more[0])
        assert cache.token_ids.shape[1] == more.shape[1] + 4 == plain.token_ids.shape[1] + 4


def test_ctrl_c_during_a_pass_that_fails_raises_keyboardinterrupt_and_undoes_it():
    with twins() as (model, cache, other, plain):
        before = held(cache)
        with Fail(model, cache, 3, "ctrl-c and an error"), pytest.raises(KeyboardInterrupt):
            step(model, cache, ids(1, seed=3))
        assert held(cache)[1] == before[1]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        torch.testing.assert_close(step(model, cache, ids(1, seed=3)),
                                   step(other, plain, ids(1, seed=3)), rtol=1e-6, atol=1e-6)


def test_ctrl_c_at_any_moment_leaves_a_cache_that_attends_rightly():
    """SIGINTs sent from another thread at seeded random moments of prompts and decode steps
    (so some land inside the cache's own code, some in the model's, some between passes): after
    each, the cache's layers agree with its ids, and its next step gives the logits of plain
    transformers over those ids."""
    import os
    import random
    import threading
    import time

    model, plain = tiny(layers=6), tiny(layers=6)  # the same weights
    rng = random.Random(0)
    with TieredCache(model, TierConfig(**TIERS), "full") as cache, torch.no_grad():
        step(model, cache, ids(40))
        for trial in range(40):
            fired = threading.Event()

            def send():
                os.kill(os.getpid(), signal.SIGINT)
                fired.set()

            timer = threading.Timer(rng.uniform(0, 0.02), send)
            try:
                timer.start()
                n = 0
                while not fired.is_set():
                    step(model, cache, ids(1 if n % 4 else 12, seed=1000 * trial + n))
                    n += 1
                time.sleep(0.01)  # the handler runs in this thread, at its next instruction
            except KeyboardInterrupt:
                pass
            timer.join()
            token = ids(1, seed=trial)
            got = step(model, cache, token)
            held = cache.token_ids
            assert {cache.layer_length(i) for i in range(6)} == {held.shape[1]}
            torch.testing.assert_close(got, plain(held).logits[0, -1], rtol=1e-5, atol=1e-5)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert cache.get_seq_length() < 4096


def test_a_step_that_reads_a_damaged_record_is_undone(tmp_path):
    """Records damaged on disk: the step that reads one stops with the record's error and
    leaves the cache as it was; the next step reads and is refused by the damage alike, not by
    a cache left half-stepped."""
    from tierkv.pipeline.groupfetch import FetchError

    model = tiny(layers=6)
    config = TierConfig(device_budget="200KB", host_budget="16KB", disk_dir=tmp_path)
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        step(model, cache, ids(300))
        cache.store.disk.flush()
        segment = next(tmp_path.glob("seg-*"))
        data = bytearray(segment.read_bytes())
        for i in range(100, len(data), 997):
            data[i] ^= 0xFF
        segment.write_bytes(bytes(data))
        before = held(cache)
        for _ in range(2):
            with pytest.raises(FetchError, match="CorruptRecordError"):
                step(model, cache, ids(1, seed=4))
            after = held(cache)
            assert torch.equal(after[0], before[0]) and after[1] == before[1]


def test_tierkv_s_step_state_is_undone_with_its_trees_held_still(tmp_path):
    """``tierkv`` with chunks that never split or merge, on a device tier small enough that its
    first layers preselect, fetching ahead (as on a GPU): its last queries, candidates and
    announced fetches are undone with a failed step, so the step run again, and the next one,
    give a never-failed cache's logits."""
    from tierkv.config import ChunkConfig

    chunks = ChunkConfig(min=8, base=8, desert_threshold=0.0)
    model, other = tiny(layers=6), tiny(layers=6)
    config = TierConfig(device_budget="500KB", host_budget="8MB")
    with TieredCache(model, config, "tierkv", chunks=chunks) as cache, \
            TieredCache(other, config, "tierkv", chunks=chunks) as plain, torch.no_grad():
        cache.fetch_ahead = plain.fetch_ahead = True
        for n in range(5):
            step(model, cache, ids(300, seed=n))
            step(other, plain, ids(300, seed=n))
        assert cache.policy.preselects(cache, 0)
        for n in range(12):
            token = ids(1, seed=50 + n)
            with Fail(model, cache, [3, 5, 6, 2][n % 4], "error in a layer"), \
                    pytest.raises(RuntimeError):
                step(model, cache, token)
            torch.testing.assert_close(step(model, cache, token), step(other, plain, token),
                                       rtol=1e-6, atol=1e-6)


def test_a_call_refused_in_another_thread_leaves_the_pass_under_way_alone():
    """While one thread's forward pass runs, another thread's is refused before it begins (and
    torch still calls the model's forward hooks for it): the pass under way goes on untouched
    and gives a never-failed cache's logits."""
    import threading

    with twins() as (model, cache, other, plain):
        paused, go, out = threading.Event(), threading.Event(), {}

        def wait(module, args):
            paused.set()
            go.wait(10)

        hook = model.model.layers[3].register_forward_pre_hook(wait)

        def run():
            with torch.no_grad():
                out["logits"] = step(model, cache, ids(1, seed=7))

        worker = threading.Thread(target=run)
        worker.start()
        assert paused.wait(10)
        hook.remove()
        with pytest.raises(RuntimeError, match="a forward pass in another thread is using it"):
            step(model, cache, ids(1, seed=8))
        go.set()
        worker.join(10)
        torch.testing.assert_close(out["logits"], step(other, plain, ids(1, seed=7)),
                                   rtol=1e-6, atol=1e-6)
        assert cache._failed is None and cache.get_seq_length() == 51


def test_a_pass_whose_thread_ended_is_undone_by_the_next_thread_to_use_the_cache():
    """A worker thread's pass stopped by what skips the model's hooks (a KeyboardInterrupt
    raised by code), the thread gone: the next use from another thread undoes it and goes on."""
    import threading

    with twins() as (model, cache, other, plain):
        def run():
            with Fail(model, cache, 3, "interrupt outside the cache"), torch.no_grad():
                with contextlib.suppress(KeyboardInterrupt):
                    step(model, cache, ids(1, seed=7))

        worker = threading.Thread(target=run)
        worker.start()
        worker.join(10)
        torch.testing.assert_close(step(model, cache, ids(1, seed=8)),
                                   step(other, plain, ids(1, seed=8)), rtol=1e-6, atol=1e-6)


def test_a_disk_budget_reached_as_a_step_seals_undoes_the_step(tmp_path):
    """A document reopened with a disk budget its directory just fits: the first step whose
    seal needs the disk fails with TierFullError saying the pass was undone (before, it failed
    part-way and the document's new tokens were lost); the cache saves elsewhere, whole."""
    model = tiny(layers=6)
    config = TierConfig(device_budget="8MB", host_budget="16KB", disk_dir=tmp_path / "a")
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        step(model, cache, ids(300))
        cache.save(tmp_path / "a")
    used = sum(path.stat().st_size for path in (tmp_path / "a").glob("seg-*"))
    config = TierConfig(device_budget="8MB", host_budget="16KB", disk_budget=used + 64)
    with TieredCache.open(model, tmp_path / "a", config) as cache, torch.no_grad():
        with pytest.raises(TierFullError, match="the forward pass is undone"):
            for n in range(40):
                step(model, cache, ids(1, seed=n))
        assert {cache.layer_length(i) for i in range(6)} == {300 + n} == \
            {cache.token_ids.shape[1]}
        cache.save(tmp_path / "b")
    with TieredCache.open(model, tmp_path / "b", TierConfig(**TIERS)) as reopened:
        assert torch.equal(reopened.token_ids[0, :300], ids(300)[0])
        assert reopened.get_seq_length() == 300 + n


def test_a_prompt_undone_leaves_the_records_of_groups_read_whole_pinned(tmp_path):
    """A long prompt's seals can make a group read whole while short selective, unpinning its
    records (the host then lets them go first); undone, the group's records are pinned again."""
    from tierkv.hf.seal import PINNED

    with twins(300, "tierkv", tmp_path, device_budget="200KB", host_budget="24KB") as \
            (model, cache, other, plain):
        def pinned(c):
            return [sorted({c.store._ranks.importance(key) == PINNED for key in index.keys})
                    for index in c.indexes]

        before = pinned(cache)
        assert [True] in before
        with Fail(model, cache, 4, "ctrl-c"), pytest.raises(KeyboardInterrupt):
            step(model, cache, ids(150, seed=5))
        assert pinned(cache) == before == pinned(plain)
