"""How a TieredCache attaches to a model and lets go of it: its attention function through
transformers' ``AttentionInterface`` (no model class is patched), two forward pre-hooks (the
token ids, the checks before a forward pass and Ctrl-C held from then on), a forward hook (the
threads of a decode step put back, a pass that failed part-way undone: ``recover.py``) and
``GenerateGuard``; a weak reference on the model names its live cache."""
from __future__ import annotations

import sys
import threading
import weakref

import torch
from transformers import AttentionInterface

from .admit import GenerateGuard, check_drafts, check_forward
from .recover import restore, roll_back


def install(cache, model) -> None:
    """Route ``model``'s attention through ``cache``; ``uninstall`` undoes as much as was done."""
    cache._model = model
    cache._attn_name = f"tierkv_{id(cache):x}"
    AttentionInterface.register(cache._attn_name, cache._attention)
    cache._previous_attn = model.config._attn_implementation
    model.set_attn_implementation(cache._attn_name)
    cache._hooks = [model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: record_ids(cache, args))]
    cache._hooks.append(model.register_forward_pre_hook(
        lambda module, args, kwargs: begin_forward(cache, args, kwargs), with_kwargs=True))
    cache._hooks.append(model.register_forward_hook(
        lambda module, args, out: end_forward(cache, out), always_call=True))
    cache._hooks.append(GenerateGuard(model, cache, check_whole))
    model._tierkv_cache = weakref.ref(cache)


def uninstall(cache) -> None:
    """Undo ``install``, as far as it went: the model attends as before and names no cache."""
    model, cache._model = getattr(cache, "_model", None), None
    if model is None:
        return
    name = getattr(cache, "_attn_name", None)
    if name is not None and model.config._attn_implementation == name:
        model.set_attn_implementation(cache._previous_attn)
    AttentionInterface._global_mapping.pop(name, None)
    for hook in getattr(cache, "_hooks", ()):
        hook.remove()
    if getattr(model, "_tierkv_cache", lambda: None)() is cache:
        model._tierkv_cache = lambda: None


def begin_forward(cache, args, kwargs) -> None:
    """Refuse, before any layer runs, what ``cache`` would attend wrongly
    (``admit.check_forward``), or anything after a forward pass that failed part-way
    (``check_whole``); a decode step (one new token) computes on ``cache.decode_threads``.

    The forward pass runs without autograd, called under ``torch.no_grad()`` or not: the tiers
    hold values, not graphs. With grad on, the records they held kept the prompt's whole graph
    alive (3.7 GB more resident after 2K tokens of SmolLM2), and a ``tierkv`` decode step raised
    from the middle of its selection (``cumsum(): functions with out=... arguments don't support
    automatic differentiation``).

    Which cores the step's threads run on is left to the scheduler. The decoding thread pinned
    to one core and the cache's threads to the other for each step (``os.sched_setaffinity``)
    was tried on the 2-core CPU (``bench.decode``'s 8K ``tierkv`` case, one cache decoding
    alternate blocks of 8 steps with and without, three runs, 2026-11-28): median steps 2.8,
    2.5 and 1.3 ms faster (of 83-103), mean steps 2.8 and 1.0 faster and 0.9 slower. Within the
    noise; not kept."""
    check_whole(cache)
    passed = kwargs.get("cache")
    passed = kwargs.get("past_key_values") if passed is None else passed
    if passed is not cache:
        given = "no cache" if passed is None else f"a {type(passed).__name__}"
        raise ValueError(f"this model's attention goes through a TieredCache until it is closed, "
                         f"but its forward pass was given {given}: pass cache=cache "
                         "(past_key_values=), or close() the cache first")
    new = check_forward(cache.get_seq_length(), cache.sliding_window, args, kwargs)
    # attends as a decode step: one new token, or a pass verifying drafted ones
    step = new == 1 or new is not None and cache.verifying and cache.get_seq_length() > 0
    if step and new > 1:
        check_drafts(cache, new - 1)  # (a crop could not take back more)
    cache._drafts = new - 1 if step else 0  # (fetches leave the windows room for them)
    if new is not None and cache.get_seq_length():  # what would not fit: refused, nothing changed
        if step:
            cache.check_room()
        else:
            cache.check_prompt_room(new)
    threads = cache.decode_threads if step else None
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"TieredCache.decode_threads={threads!r}: expected a positive int, or "
                         "None to leave torch's threads as they are")
    cache._start = cache.token_ids.shape[1], cache.get_seq_length(), cache.steps
    cache._sealed_in_pass = {}  # group -> where its chunks ended before the pass sealed (``seal``)
    cache._pinned_at_start = set(cache._pinned)
    cache.policy.mark()
    cache._thread = threading.get_ident()
    cache._before = (torch.get_num_threads() if threads is not None else None,
                     torch.is_grad_enabled())
    cache._in_forward = True
    cache._held.hold()  # Ctrl-C from now on: ``recover``
    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_grad_enabled(False)


def check_open(cache) -> None:
    """RuntimeError for a cache that was closed (its tiers released)."""
    if cache._model is None:
        raise RuntimeError("this TieredCache is closed: make a new one (TieredCache.open "
                           "reopens a saved document)")


def check_whole(cache, doing: str = "go on") -> None:
    """RuntimeError when a forward pass through ``cache`` failed part-way (an error, a full
    disk, Ctrl-C) and could not be undone (``recover.roll_back``): some layers then hold the
    pass's tokens and others not, and nothing it computes is right. A pass that something other
    than an ``Exception`` stopped (it skipped ``end_forward``) is undone here first, in its own
    thread or, when that thread has ended, in this one. A closed cache: ``check_open``."""
    check_open(cache)
    mine = cache._thread == threading.get_ident()
    if cache._failed is None and cache._in_forward and not mine and \
            cache._thread not in {thread.ident for thread in threading.enumerate()}:
        cache._before, cache._thread, mine = None, threading.get_ident(), True  # (its modes
        # were its thread's)
    if cache._failed is None and cache._in_forward and mine:
        restore(cache)
        cache._held.release()
        roll_back(cache)
    if cache._failed is None and not cache._in_forward:
        return
    if cache._failed is None:
        raise RuntimeError(f"this TieredCache cannot {doing}: a forward pass in another thread "
                           "is using it (a cache serves one forward pass at a time)")
    if mine:
        restore(cache)  # (a pass stopped by what skipped ``end_forward`` left them)
        cache._held.release()
    raise RuntimeError(f"this TieredCache cannot {doing}: a forward pass failed part-way "
                       f"({cache._failed}), so its layers hold different lengths; close() it (a "
                       "saved document reopens as it was saved) and start again")


def end_forward(cache, out) -> None:
    """After a forward pass, whether it ended or raised an ``Exception`` (then torch calls this
    hook as it handles it, with ``out`` None): the compute threads a decode step changed and
    autograd's mode put back (``recover.restore``); a pass that failed undone, one that ended
    done; a Ctrl-C held during the pass raised now (in place of the failed pass's exception, a
    ``KeyboardInterrupt`` being the one this hook may raise). Nothing for a call refused before
    its pass began in another thread than the pass under way's (torch calls this hook then too)."""
    if cache._thread != threading.get_ident():
        return
    restore(cache)
    cache._drafts = 0
    if out is None and cache._in_forward:
        raised = sys.exc_info()[1]  # (the exception torch is handling)
        if cache._cause is None and raised is not None:
            cache._cause = f"{type(raised).__name__}: {raised}"
        roll_back(cache)
    else:
        cache._in_forward = False
    if cache._held.release() and cache._failed is None:
        raise KeyboardInterrupt


def record_ids(cache, args) -> None:
    """Append the ids entering the model's embeddings to ``cache.token_ids``."""
    ids = args[0]
    if ids.dim() == 2 and ids.shape[1] == 0 and cache.get_seq_length() > 0:
        cache._in_forward = False  # refused before any layer ran: nothing changed
        raise ValueError(f"no new tokens reach the model: the cache holds "
                         f"{cache.get_seq_length()} tokens and generate feeds only the ids past "
                         "them; pass cache.token_ids followed by the new tokens")
    if ids.dim() == 2 and ids.shape[0] == 1:
        cache.token_ids = torch.cat([cache.token_ids, ids.detach().cpu().long()], dim=1)
