"""A forward pass through a ``TieredCache`` that fails part-way, and Ctrl-C during one.

A pass that stops part-way leaves its first layers holding its tokens and the others not;
``roll_back`` takes them out. Tokens still in the recent windows are cut from them; what a group
sealed in the pass (older tokens as a decode step's window fills, a long prompt's own, group by
group) is taken back out of its index and the store, to where its chunks ended before
(``ChunkTree.mark``, taken by ``seal``), and the tokens that were in the windows go back there
(read from the records: where those spilled to disk under a lossy codec, as the codec gives them
back). The token ids, the windows, the chunk trees, the policy's state (``Policy.mark`` /
``roll_back``: ``h2o``'s accumulated attention and evictions, the selectors' running scores,
``tierkv``'s last queries and candidates) and the pinned ranks of records are then as before the
pass, and its fetches are let go; what a failed pass's attention taught the adaptive trees of
``leoam`` and ``tierkv`` (their folds) is kept, and records its stores spilled from the host to
disk stay there (under a lossy codec, as the codec stored them). A failure while the cache was
changing its indexes or trees (``changing``: a chunk tree's fold, a record rewrite), an
interrupt raised inside the cache's own code, or one while undoing (a damaged record to read
back) leaves a cache that refuses to go on (``hooks.check_whole``), as every failed pass did
before. A pass is undone as its exception leaves the model (``hooks.end_forward``, which torch
calls for an ``Exception``), or, for one that skips the model's forward hooks (a
``KeyboardInterrupt`` that was not held), at the cache's next use (a forward pass, ``save``,
``generate``).

Ctrl-C during a pass (SIGINT in the main thread, under Python's own handler) is held
(``HeldInterrupt``): a decode step ends first, so the cache holds its token, and the
``KeyboardInterrupt`` comes as the step returns; a prompt stops when its next layer attends and
is rolled back. A second Ctrl-C stops at once, wherever the pass is: the cache then refuses to go
on.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import weakref
from concurrent import futures

import torch

from ..storage.base import KVBlock
from ..workers import restore_threads
from .seal import PINNED


class HeldInterrupt:
    """Holds a SIGINT that arrives during a forward pass through ``cache`` (``hold`` ..
    ``release``), where Python's default handler is installed and the pass runs in the main
    thread (where signals arrive); elsewhere it changes nothing."""

    def __init__(self, cache):
        self._cache = weakref.ref(cache)
        self._previous = None  # the handler ours replaced, while held
        self._handler = self._handle
        self.pending = False

    def hold(self) -> None:
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        if current is not signal.default_int_handler and current != self._handler:
            return  # the application's own handler decides
        self.pending = False
        signal.signal(signal.SIGINT, self._handler)
        self._previous = signal.default_int_handler

    def release(self) -> bool:
        """Put Python's handler back; whether a SIGINT arrived meanwhile. (Ours, left installed
        by a SIGINT that came as it was being put back, acts as Python's outside a pass.)"""
        previous, self._previous = self._previous, None
        if previous is not None and signal.getsignal(signal.SIGINT) == self._handler:
            signal.signal(signal.SIGINT, previous)
        pending, self.pending = self.pending, False
        return pending

    def _handle(self, signum, frame) -> None:
        cache = self._cache()
        # held, in a pass still under way (not one that something other than an Exception
        # stopped, which skips ``end_forward``: then this acts as Python's handler)
        live = self._previous is not None and cache is not None and _running(frame, cache._model)
        if live and not self.pending:
            self.pending = True  # raised as the step ends, or when the prompt's next layer attends
            return
        if live:  # a second Ctrl-C: at once, wherever the pass is
            cache._failed = "KeyboardInterrupt: Ctrl-C twice, the pass stopped where it was"
        if cache is not None and self._previous is not None:
            restore(cache)
        self.release()
        raise KeyboardInterrupt


_CALL = torch.nn.Module._call_impl.__code__


def _running(frame, model) -> bool:
    """Whether ``frame`` is inside a call of ``model`` (its ``Module._call_impl``)."""
    while frame is not None:
        if frame.f_code is _CALL and frame.f_locals.get("self") is model:
            return True
        frame = frame.f_back
    return False


def stop(cache) -> None:
    """Raise the held Ctrl-C of a prompt between two layers: the pass rolled back first."""
    cache._cause = "KeyboardInterrupt: Ctrl-C"
    roll_back(cache)
    restore(cache)
    cache._held.release()
    raise KeyboardInterrupt


def failed(cache, exc: BaseException) -> None:
    """Note ``exc``, raised inside the cache's attention: undone with the pass (``roll_back``)
    unless it came while the cache was changing its records (``changing``) or is an interrupt
    that may have landed anywhere in the cache's code (not a held Ctrl-C)."""
    cause = f"{type(exc).__name__}: {exc}"
    if cache._failed is None and not isinstance(exc, Exception):
        cache._failed = cause
    elif cache._failed is None:
        cache._cause = cause


@contextlib.contextmanager
def changing(cache):
    """Mark a change to the cache's records or trees that a failure would leave half done: one
    that raises leaves a cache that refuses to go on."""
    try:
        yield
    except BaseException as exc:
        if cache._failed is None:
            cache._failed = f"{type(exc).__name__}: {exc}"
        raise


def restore(cache) -> None:
    """Put back the compute threads a decode step changed (``TieredCache.decode_threads``), the
    count new threads start with (``workers.restore_threads``) and autograd's mode."""
    before, cache._before = cache._before, None
    restore_threads()  # the cache's threads may have started since: their count is theirs
    if before is None:
        return
    threads, grad = before
    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)


def roll_back(cache) -> None:
    """After a forward pass that stopped before its last layer attended: put the cache back as
    it was before the pass, or, where that cannot be done, note why (``cache._failed``)."""
    if not cache._in_forward or cache._failed is not None:
        return
    try:
        why = _undo(cache)
    except Exception as exc:  # noqa: BLE001 - the cause is kept for the next use to name
        why = f"undoing it raised {type(exc).__name__}: {exc}"
    if why is not None:
        cause = cache._cause or "KeyboardInterrupt outside the cache's attention"
        cache._failed = f"{cause}; it cannot be undone: {why}"
    cache._cause = None


def _undo(cache) -> str | None:
    ids, held, steps = cache._start
    for g in list(cache._folds):  # a tree's fold on the helper thread: ended, or it broke the tree
        try:
            cache._folds.pop(g).result()
        except Exception as exc:  # noqa: BLE001
            return f"a fold of layer group {g}'s chunk tree raised {type(exc).__name__}: {exc}"
    _let_go_of_reads(cache)
    taken = _unseal(cache, held)
    for g in cache._pinned_at_start - cache._pinned:  # unpinned by the pass's seals: pinned again
        for key in cache.indexes[g].keys:
            with contextlib.suppress(KeyError):
                cache.store.set_importance(key, PINNED)
    cache._pinned = set(cache._pinned_at_start)
    for layer in range(cache.shape.layers):
        cache._window.put_back(layer, taken.get(layer, cache._pending[layer]),
                               held - cache.indexes[cache.group_of[layer]].sealed)
        cache._pending[layer] = []
        cache._fresh[layer] = False
    cache.token_ids = cache.token_ids[:, :ids]
    cache.policy.roll_back(cache, held)  # (its ``mark`` was taken as the pass began)
    cache.prompt_mass.clear()
    cache.prompt_query.clear()
    cache.asking = False
    cache.question_choice.clear()
    cache._chosen.clear()
    cache._held_positions = None
    cache.steps = steps
    cache._in_forward = False
    return None


def _unseal(cache, held: int) -> dict[int, list]:
    """Take what the pass sealed out of its groups' indexes and the store (back to
    ``cache._sealed_in_pass``); per layer of those groups, the blocks of its tokens from where
    its group's chunks ended before, up to ``held``, to go back to its window. All are read
    before anything is changed."""
    marks = cache._sealed_in_pass
    read = {g: cache.store.fetch([key for key in cache.indexes[g].keys
                                  if marks[g][0] <= key.start < held], "cpu") for g in marks}
    taken = {}
    for g, mark in marks.items():
        for key in cache.indexes[g].truncate(mark):
            cache.store.remove(key)
        for slot, layer in enumerate(cache.groups[g]):
            taken[layer] = [KVBlock(b.keys[slot], b.values[slot]) for b in read[g]]
    marks.clear()
    return taken


def _let_go_of_reads(cache) -> None:
    """Cancel the pass's prefetches and the prefill's reads ahead; let go of what its fetches
    held on the device tier."""
    ahead, cache.prefill_ahead, cache.prefill_staged = cache.prefill_ahead, None, None
    if ahead is not None and not ahead[3].cancel():
        futures.wait([ahead[3]])
    for key, held in cache._step.items():
        if key[0] == "prefetch":
            held[1].cancel()
    cache._step.clear()
    cache._kept.clear()
    device = cache.store.device
    for g in range(len(cache.groups)):
        device.reserve(f"fetch:{g}", 0)
        device.reserve(f"prefetch:{g}", 0)
    for layer in range(cache.shape.layers):
        device.reserve(f"prefill:{layer}", 0)
