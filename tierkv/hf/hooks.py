"""How a TieredCache attaches to a model and lets go of it: its attention function through
transformers' ``AttentionInterface`` (no model class is patched), two forward pre-hooks (the
token ids, the checks before a forward pass) and ``GenerateGuard``; a weak reference on the model
names its live cache."""
from __future__ import annotations

import weakref

from transformers import AttentionInterface

from .admit import GenerateGuard


def install(cache, model) -> None:
    """Route ``model``'s attention through ``cache``; ``uninstall`` undoes as much as was done."""
    cache._model = model
    cache._attn_name = f"tierkv_{id(cache):x}"
    AttentionInterface.register(cache._attn_name, cache._attention)
    cache._previous_attn = model.config._attn_implementation
    model.set_attn_implementation(cache._attn_name)
    cache._hooks = [model.get_input_embeddings().register_forward_pre_hook(cache._record_ids)]
    cache._hooks.append(model.register_forward_pre_hook(cache._begin_forward, with_kwargs=True))
    cache._hooks.append(GenerateGuard(model, cache))
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
