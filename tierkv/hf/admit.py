"""What a TieredCache checks and settles before it is built: its arguments, whether the model is
one it can serve, the device its tiers follow, and the document it writes (held for its life);
and, when its device tier turns a reservation down, what that reservation was for.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from ..config import ChunkConfig, SelectConfig, TierConfig
from ..shapes import text_config
from ..storage.base import RecordKey
from ..storage.locking import DocInUseError

_ids = itertools.count()  # docN names of this process; another process counts from doc0 too


def claim_doc(disk, doc: str | None, resume: bool) -> str:
    """The document a new cache writes: ``doc``, or the first ``docN`` the directory does not
    hold; held (``DiskTier.hold_doc``) until the cache closes, so that no other live cache, of
    this or another process, writes it too (DocInUseError when one does). A new cache is refused
    a document the directory holds: its records would replace the saved ones."""
    if disk is None:
        return doc or f"doc{next(_ids)}"
    names = [doc] if doc is not None else (f"doc{i}" for i in _ids)
    for name in names:
        if doc is None and name in disk.docs():
            continue
        try:
            disk.hold_doc(name)
        except DocInUseError:
            if doc is not None:
                raise
            continue
        disk.refresh()  # what a cache that let the name go wrote since this directory was read
        if resume or name not in disk.docs():
            return name
        disk.release_doc(name)
        if doc is not None:
            if doc in disk.saved_docs():
                raise ValueError(f"{disk.path} already holds document {doc!r}: reopen it with "
                                 f"TieredCache.open(model, dir, doc={doc!r}), or pass another doc=")
            raise ValueError(f"{disk.path} holds records of document {doc!r}, never saved (a run "
                             "that did not save, or crashed): pass another doc=, or remove them "
                             "first (KVStore.delete_doc)")


def on_model_device(config: TierConfig, model) -> TierConfig:
    """``config`` with its device tier where ``model`` computes: ``device="auto"`` becomes the
    model's device (attention runs there, so its KV must be there too); another device than the
    model's is refused."""
    param = next(model.parameters(), None)
    if param is None:
        return config
    here = param.device
    if here.type not in ("cpu", "cuda"):
        raise ValueError(f"the model is on {here}: TieredCache runs models on 'cpu' or 'cuda'")
    if config.device == "auto":
        return dataclasses.replace(config, device=str(here))
    wanted, here = indexed(config.torch_device), indexed(here)
    if wanted != here:
        raise ValueError(f"TierConfig(device={config.device!r}): the model is on {here}; the "
                         f"device tier must be where the model computes (device='auto' follows it)")
    return config


def sliding_window(config) -> int | None:
    """The sliding window of a model whose layers attend only that far back, or None."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    return window if getattr(config, "use_sliding_window", True) else None


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare "cuda" is the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_args(model, config, select, chunks, prefill_block, doc) -> None:
    """Clear errors for arguments of the wrong kind, before anything is built."""
    if not hasattr(model, "config") or not callable(getattr(model, "parameters", None)):
        raise ValueError(f"model={type(model).__name__}: expected a loaded transformers model "
                         "(e.g. from tierkv.load_model)")
    if not getattr(type(model), "_supports_attention_backend", False):
        raise ValueError(f"{type(model).__name__} does not run its attention through "
                         "transformers' AttentionInterface, which a TieredCache takes over: "
                         "it serves decoder-only models that do (Llama, Qwen2, Mistral families)")
    text = text_config(model.config)
    attention = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx")
                 and getattr(m, "config", text) is text]  # the text model's (not a vision tower's)
    if attention and len(attention) != text.num_hidden_layers:
        raise ValueError(f"{type(model).__name__} has {len(attention)} attention layers but its "
                         f"config says num_hidden_layers={text.num_hidden_layers} (layers removed "
                         "without the config?): the cache keeps one entry per configured layer")
    if getattr(text, "is_encoder_decoder", False) or any(not m.is_causal for m in attention):
        raise ValueError(f"{type(model).__name__} attends both ways (not causal), which a "
                         "TieredCache's attention does not: it serves decoder-only models "
                         "(Llama, Qwen2, Mistral families)")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in attention):
        raise ValueError(f"{type(model).__name__} adds learned attention sinks to its softmax, "
                         "which a TieredCache's attention does not: it serves Llama, Qwen2 and "
                         "Mistral families")
    if getattr(text, "attn_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} caps its attention logits "
                         f"(attn_logit_softcapping={text.attn_logit_softcapping}), which a "
                         "TieredCache's attention does not: it serves Llama, Qwen2 and Mistral "
                         "families")
    for name, value, kind in (("config", config, TierConfig), ("select", select, SelectConfig),
                              ("chunks", chunks, ChunkConfig)):
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{name}={type(value).__name__}: expected a {kind.__name__} (or None)")
    if isinstance(prefill_block, bool) or not isinstance(prefill_block, int) or prefill_block < 1:
        raise ValueError(f"prefill_block={prefill_block!r}: must be a positive integer")
    if doc is not None:
        RecordKey(doc, 0, 0, 1)  # a ValueError naming it when records could not carry it


def check_forward(held: int, window: int | None, args, kwargs) -> int | None:
    """Refuse a forward pass (the model's ``args``, ``kwargs``) that a cache holding ``held``
    tokens would attend wrongly: masked tokens (padding), new tokens placed elsewhere than after
    the held ones, or a context longer than the model's sliding ``window``. Returns the number
    of new tokens (None when neither ids nor embeddings are given)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise ValueError(f"attention_mask masks {int((mask == 0).sum())} of its {mask.numel()} "
                         "tokens (padding?): a TieredCache attends every token of its one "
                         "sequence; pass the ids unpadded, with no zeros in attention_mask")
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.numel() and positions.dim() == 2 \
            and int(positions[0, 0]) != held:
        raise ValueError(f"the new tokens would sit at position {int(positions[0, 0])}, but the "
                         f"cache holds {held}: generate was given fewer ids than the cache "
                         "holds; pass cache.token_ids followed by the new tokens")
    new = kwargs.get("input_ids", args[0] if args else None)
    if new is None:
        new = kwargs.get("inputs_embeds")
    if isinstance(new, torch.Tensor) and new.dim() >= 2 and new.shape[0] != 1:
        raise ValueError(f"batch size {new.shape[0]}: a TieredCache holds one sequence (beam "
                         "search, num_return_sequences > 1 and batches need one cache each)")
    count = new.shape[1] if isinstance(new, torch.Tensor) and new.dim() >= 2 else None
    tokens = held + (count or 0)
    if window is not None and tokens > window:
        raise ValueError(f"{tokens} tokens pass the model's sliding window ({window}): its "
                         "layers attend only that far back, while a TieredCache attends the "
                         "whole context")
    return count


def check_prefix(held_ids: torch.Tensor, input_ids: torch.Tensor) -> None:
    """Refuse ``input_ids`` (1, n) that ``generate`` would feed from position ``held`` on when
    their first ``held`` ids are not the cache's (``held_ids``, (1, held)): generate takes those
    as the cached ones without looking, so another prompt would be answered against this one's
    context."""
    mine, held = held_ids[0], held_ids.shape[1]
    given = input_ids[0, :held].to(mine.device)
    if not torch.equal(given, mine):
        at = int((given != mine).nonzero()[0, 0])
        raise ValueError(f"the ids given to generate differ from the cache's at position {at} "
                         f"(of the {held} it holds): generate feeds only the ids past them, so "
                         "the new tokens would follow another text; pass cache.token_ids followed "
                         "by the new tokens, or start a new cache for another text")


class GenerateGuard:
    """Wraps ``model.prepare_inputs_for_generation`` so that each ``generate`` call on ``cache``
    checks, before its first forward pass, that its ids continue the cache's (``check_prefix``),
    and ``model.generate`` so that it first calls ``settle(cache)`` (``hooks.check_whole``: a
    pass that something other than an ``Exception`` stopped is undone before generate reads the
    cache's length); ``remove()`` unwraps both. Only where generate slices the ids (they start
    with the cached ones) and the cache knows its ids (they were fed as ``input_ids``).

    Assisted and prompt-lookup decoding feed their first pass whole, assuming an empty cache (a
    ``DynamicCache`` then holds the held tokens twice): through a cache holding tokens, that pass
    is fed only the new ones. Each of their passes is refused, before it runs, when it drafts
    more tokens than a crop can take back after it (``SelectConfig.window``). Their passes after
    the first set ``cache.verifying``: they attend as decode steps do."""

    def __init__(self, model, cache, settle):
        self.model, self.prepare = model, getattr(model, "prepare_inputs_for_generation", None)
        self.wrapper = self.generate = None
        self.prompt: int | None = None  # the ids given to an assisted generate call under way
        # what the model's own attributes were (an application's wrapper), put back by remove()
        self.own = {name: vars(model).get(name) for name in ("prepare_inputs_for_generation",
                                                             "generate")}
        if self.prepare is None:  # a model without generate
            return
        generate = getattr(model, "generate", None)
        if generate is not None:
            @functools.wraps(generate)
            def guarded(*args, **kwargs):
                settle(cache)
                ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
                self.prompt = ids.shape[-1] if _drafting(model, kwargs) and \
                    isinstance(ids, torch.Tensor) else None
                try:
                    return generate(*args, **kwargs)
                finally:
                    self.prompt, cache.verifying = None, False

            model.generate = self.generate = guarded

        @functools.wraps(self.prepare)  # generate reads its signature
        def prepare(input_ids, *args, **kwargs):
            passed = kwargs.get("cache", kwargs.get("past_key_values"))  # "cache" from 5.24 on
            if passed is cache and isinstance(input_ids, torch.Tensor) and input_ids.shape[0] == 1:
                held, first = cache.get_seq_length(), kwargs.get("is_first_iteration")
                known = held and cache.token_ids.shape[1] == held
                # a first pass verifies too when all it brings besides drafts is the last id
                cache.verifying = self.prompt is not None and (
                    not first or bool(known) and self.prompt - held == 1)
                if self.prompt is not None:  # assisted: its passes verify drafted tokens
                    if first and known and "next_sequence_length" in kwargs and \
                            kwargs["next_sequence_length"] is None and input_ids.shape[1] > held:
                        kwargs["next_sequence_length"] = input_ids.shape[1] - held
                    if first:  # (later passes verify: begin_forward checks their drafts)
                        check_drafts(cache, input_ids.shape[1] - self.prompt)
                if first and known and kwargs.get("next_sequence_length") == \
                        input_ids.shape[1] - held > 0:  # once a generate call
                    check_prefix(cache.token_ids, input_ids)
            return self.prepare(input_ids, *args, **kwargs)

        model.prepare_inputs_for_generation = self.wrapper = prepare

    def remove(self) -> None:
        for name, wrapper in (("prepare_inputs_for_generation", self.wrapper),
                              ("generate", self.generate)):
            if wrapper is None or vars(self.model).get(name) is not wrapper:
                continue  # not wrapped, or wrapped again since: left as it is
            if self.own[name] is None:
                delattr(self.model, name)
            else:
                setattr(self.model, name, self.own[name])


def _drafting(model, kwargs: dict) -> bool:
    """Whether a ``generate`` call given ``kwargs`` drafts tokens (assisted or prompt-lookup
    decoding), by its arguments, its ``generation_config`` or the model's."""
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    return kwargs.get("assistant_model") is not None or any(
        kwargs.get(name, getattr(config, name, None)) is not None
        for config in configs for name in ("prompt_lookup_num_tokens", "assistant_early_exit"))


def check_drafts(cache, drafted: int) -> None:
    """Refuse a pass verifying ``drafted`` tokens, before it runs, when a crop could not take
    all of them back after it: every layer's recent window keeps at least
    ``SelectConfig.window`` tokens after a pass, and a crop reaches no further."""
    window = cache.select.window
    if drafted > window:
        raise ValueError(
            f"a pass verifying {drafted} drafted tokens: a TieredCache takes back at most "
            f"{window} after it (SelectConfig.window), which the rejected ones may exceed. "
            "Draft fewer (prompt_lookup_num_tokens, or the assistant's num_assistant_tokens: "
            "its 'heuristic' schedule grows them) or keep a larger window; nothing was fed")


def device_need(tag: str, per_token: int) -> str:
    """What the device tier holds under ``tag`` (a reservation's name), in words; ``per_token``
    is one token's keys and values in one layer, in bytes."""
    kind = tag.split(":")[0]
    if kind == "prefill":
        return (f"a prompt is prefilled one layer at a time, and the layer attending holds the "
                f"keys and values of the whole sequence on the device ({per_token} B a token)")
    if kind == "window":
        return (f"every layer keeps its recent tokens on the device until they are sealed, "
                f"a new prompt's whole during prefill ({per_token} B a token and layer)")
    return ("a decode step brings each layer group's chosen chunks to the device beside the "
            "recent windows (a smaller SelectConfig.budget, --budget, brings fewer)")
