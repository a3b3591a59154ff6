"""``TieredCache``: a transformers ``Cache`` whose KV lives on the device, host and disk tiers.

The cache installs one attention function (through ``AttentionInterface``) bound to itself on
the model, and removes it on ``close()``. ``update()`` only appends the new keys and values to
the layer's recent window; the attention function does the work:

- several new tokens (prefill, a new turn): exact causal attention in query blocks over the
  layer's whole context (``prefill.py``);
- one new token (decode): the policy names the chunks to fetch, the cache brings them up (once
  per layer group and step) and the policy attends over them plus the window.

After a layer attends, its window beyond the last ``window`` tokens is cut into chunks; when the
last layer of a group has done so, the group's chunks are sealed into the store as one record each.
A forward pass that fails part-way is undone where none of its tokens was sealed (``recover.py``).
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from ..config import ChunkConfig, SelectConfig, TierConfig
from ..pipeline import CompressionController, Metrics, Pipeline
from ..pipeline.transfer import as_caller
from ..policies import Policy, make_policy
from ..scattered import Scattered, layer_parts, reads_in_place
from ..shapes import KVShape
from ..storage.base import KVBlock, TierFullError
from ..storage.probe import read_bandwidth
from ..storage.store import KVStore
from ..workers import worker_pool
from .admit import check_args, claim_doc, device_need, on_model_device, sliding_window
from .crop import crop
from .fetching import GroupFetches
from .groups import Fetch, GroupIndex
from .hooks import check_open, install, uninstall
from .prefill import prefill_attention
from .profile import check_profile, load_profile
from .recover import HeldInterrupt, changing, failed, restore, stop
from .seal import PINNED, seal
from .window import RecentWindows



class TieredLayer(CacheLayerMixin):
    """transformers' per-layer view of a ``TieredCache`` (lengths; the data lives in the tiers)."""

    def __init__(self, cache: "TieredCache", layer: int):
        super().__init__()
        self.cache, self.layer = cache, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.append(self.layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cache.layer_length(self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class TieredCache(GroupFetches, Cache):
    """A KV cache on three tiers for one sequence (batch size 1).

    Parameters
    ----------
    model : a loaded transformers decoder-only model (Llama, Qwen2, Mistral families).
    config : TierConfig -- budgets and places of the tiers.
    policy : name of a policy (``tierkv`` by default; see ``tierkv.policies.REGISTRY``).
    select, chunks : SelectConfig and ChunkConfig (defaults when omitted).
    doc : the document id under which records are stored; by default the first ``docN`` the
        disk directory does not hold. A document the directory already holds is refused (reopen
        it with ``TieredCache.open``): new records would replace its own.
    profile : the model's calibration profile (filter layers, retrieval heads); by default the
        profile shipped for the model, when there is one.
    prefill_block : query block size of the layer-wise prefill.

    Attributes
    ----------
    fetch_ahead : whether fetches ranked by a layer's query of the last step (``Policy.ahead``:
        ``tierkv``'s preselected candidates) start while the layers before it compute. On by
        default where the device is a GPU, whose copies run beside the compute; off on a CPU,
        where they take the cores the step computes on (``policies/tierkv.py``).
    decode_threads : torch's compute threads during a decode step (put back after it), or None
        (the default) to leave them. One fewer than torch's once paid on the 2-core CPU, while
        the pipeline's threads packed every fetch (``bench.decode``'s 8K ``tierkv`` case: 93.7
        ms a token on one thread against 97.2). With fetches read in place, and the cache's
        threads computing on one thread each (``tierkv.workers``), the step's matrix products
        are a third of it and two threads halve them: one cache decoding alternate blocks of 8
        steps (2026-11-28) took 69.1 ms a token on two threads against 87.9 on one (median 66.9
        against 85.2).
    verifying : whether a pass of several tokens on a cache holding more verifies drafted ones,
        attending as a decode step does (what each token would choose, where the device holds
        it), not as a question: set by an assisted or prompt-lookup ``generate`` (``admit``).
    in_place : whether a CPU decode step attends its fetched records where the tiers hold them
        (``tierkv.scattered``) instead of packed into a block: on where the kernel runs and the
        policy reads parts (``Policy.reads_parts``: ``omnikv``, ``tierkv``).
    """

    def __init__(self, model, config: TierConfig | None = None, policy: str = "tierkv", *,
                 select: SelectConfig | None = None, chunks: ChunkConfig | None = None,
                 doc: str | None = None, profile: dict | None = None, prefill_block: int = 512,
                 _resume: bool = False, _disk=None):
        check_args(model, config, select, chunks, prefill_block, doc)
        live = getattr(model, "_tierkv_cache", lambda: None)()
        if live is not None and live._model is not None:
            raise ValueError(f"the model already serves a live TieredCache (document "
                             f"{live.doc!r}): close() it first (a cache stays live until closed, "
                             "referenced or not), or load a second model; two caches cannot "
                             "share one model's attention")
        config = on_model_device(config or TierConfig(), model)
        self.shape = KVShape.from_config(model.config, dtype=model.dtype)
        self.sliding_window = sliding_window(model.config)
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.shape.layers)])
        self.config, self.prefill_block = config, prefill_block
        self.select, self.chunks = select or SelectConfig(), chunks or ChunkConfig()
        if profile is not None:  # a shipped or calibrated one is checked as it loads
            check_profile(profile, self.shape.layers, self.shape.kv_heads)
        self.profile = profile if profile is not None else load_profile(model)
        self.policy: Policy = make_policy(policy, self.shape.layers, self.select, self.chunks, self.profile)
        self.groups = self.policy.groups()
        self.group_of = {layer: g for g, group in enumerate(self.groups) for layer in group}
        self.slot_of = {layer: i for group in self.groups for i, layer in enumerate(group)}
        self.record_tokens = [self.policy.record_tokens(group) for group in self.groups]
        self.leaf_tokens = [self.policy.leaf_tokens(group) for group in self.groups]
        auto = config.codec.codec == "auto" and config.disk_dir is not None
        controller = CompressionController.from_config(config.codec) if auto else None
        self.store = KVStore(self.shape, config, controller, _disk)
        try:
            self.doc = claim_doc(self.store.disk, doc, _resume)
            self._new_doc = not _resume  # claimed unheld and absent: every record of it is ours
            self._build(config, controller)
            install(self, model)
        except BaseException:
            self._let_go()
            raise

    def _build(self, config: TierConfig, controller) -> None:
        """What the cache needs beside its store: indexes, pipeline, windows, counters."""
        self.indexes = [GroupIndex(self.doc, g, self.shape.kv_heads, self.shape.head_dim, self.chunks)
                        for g in range(len(self.groups))]
        if controller is not None:  # prefill writes come before any read measures the disk
            controller.assume_disk(read_bandwidth(self.store.disk.path))
        self.device = self.store.device.device
        self.fetch_ahead = self.device.type == "cuda"
        self.in_place = self.policy.reads_parts and reads_in_place(self.shape, self.device)
        self.decode_threads: int | None = None
        self._before = None  # torch's threads and grad mode before a forward pass changed them
        self.metrics = Metrics()
        self.pipeline = Pipeline(self.store, self.device, threads=min(config.io_threads, 4),
                                 metrics=self.metrics, groups=len(self.groups))
        layers = range(self.shape.layers)
        self._window = RecentWindows([self.spare_tokens(self.group_of[i]) for i in layers],
                                     self.shape.kv_heads, self.shape.head_dim, self.shape.dtype,
                                     self.device, self.reserve)
        self._pending: list[list[KVBlock]] = [[] for _ in layers]
        self._fresh = [False] * self.shape.layers
        self._step: dict = {}
        self._kept: dict = {}  # group -> (keys, Scattered) it read in place last step (``fetched``)
        self._chosen: list[int] = []  # groups whose selection waits for the chooser's release
        self._held_positions = None  # (fetched positions, (sealed, window), attended positions)
        self._in_forward = False  # a forward pass has begun and not yet returned
        self._failed: str | None = None  # why a pass that failed part-way cannot be undone
        self._cause: str | None = None  # what stopped the pass under way (``recover``)
        self._held = HeldInterrupt(self)  # Ctrl-C during a pass
        self._start = (0, 0, 0)  # the ids, tokens and steps when the last forward pass began
        self._sealed_in_pass: dict = {}  # group -> ``ChunkTree.mark`` before the pass sealed
        self._thread: int | None = None  # the thread that began it
        self.steps = 0  # decode steps so far: the importance of what a step reads or seals
        self.trimmed_fetches = self.trimmed_tokens = 0  # fetches ``fit_to_device`` cut down
        self._pinned: set[int] = set()  # groups whose records were sealed or read as PINNED
        self._pinned_at_start: set[int] = set()  # those as the last forward pass began
        self.token_ids = torch.zeros(1, 0, dtype=torch.long)
        self.snapshot: set | None = None  # disk records of the saved document this cache holds
        self.prefill_staged = self.prefill_ahead = None  # layers' sealed KV, the next (prefill.py)
        self.prompt_mass: dict[int, torch.Tensor] = {}  # layer -> its recent queries' attention
        self.prompt_query: dict[int, torch.Tensor] = {}  # layer -> the prompt's last query (CPU)
        self.asking = False  # whether the forward pass is a question (``prefill.asks``)
        self.verifying = False  # whether passes of several tokens verify drafted ones (``admit``)
        self.question_choice: dict[int, torch.Tensor] = {}  # group -> its leaves for the question
        self.reader = worker_pool(1, "tierkv-helper")  # prefill's reads
        self._folds: dict = {}  # group -> its tree's fold running on ``reader`` (``in_background``)

    def _let_go(self) -> None:
        """Undo a construction that failed part-way: the model's attention, the threads, the
        tiers, the document held."""
        uninstall(self)
        if hasattr(self, "reader"):
            self.reader.shutdown(wait=True, cancel_futures=True)
        if hasattr(self, "pipeline"):
            self.pipeline.close()
        self.store.close()

    changing = changing  # ``with cache.changing():`` a change a failure would leave half done

    # -- transformers' side ------------------------------------------------------------
    def append(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Append new K/V, shape (1, kv_heads, t, head_dim), to ``layer``'s recent window."""
        if not self._in_forward:  # keys from a model whose forward pass this cache did not see
            raise RuntimeError(
                "this TieredCache is closed: make a new one" if self._model is None else
                f"this TieredCache serves the {type(self._model).__name__} it was made with; a "
                "forward pass of another model cannot go through it (make a cache for that model)")
        if key_states.shape[0] != 1:
            raise ValueError(f"TieredCache holds one sequence; got batch size {key_states.shape[0]}")
        self._window.append(layer, key_states[0], value_states[0])
        self._fresh[layer] = True
        return key_states, value_states

    def layer_length(self, layer: int) -> int:
        pending = sum(b.keys.shape[2] for b in self._pending[layer])
        return self.indexes[self.group_of[layer]].sealed + pending + self._window[layer][0].shape[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer_length(layer_idx)

    def shortest_window(self) -> int:
        return self._window.shortest()

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)``: take back the newest ``n`` tokens, as assisted and prompt-lookup
        decoding do after a pass verifying drafted ones (``hf/crop.py``)."""
        crop(self, tokens_to_remove)

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        prompt = query.shape[2] > 1  # Ctrl-C stops a prompt between layers, a decode step after
        if prompt and self._held.pending:
            stop(self)
        try:
            out = self._attend(module, query, scaling)
        except BaseException as exc:
            failed(self, exc)
            raise
        if prompt and self._held.pending and module.layer_idx < self.shape.layers - 1:
            stop(self)
        return out, None

    def _attend(self, module, query, scaling):
        layer = module.layer_idx
        if not self._fresh[layer]:
            raise RuntimeError(f"layer {layer} attends through a TieredCache that did not receive its "
                               "keys: pass cache=cache (past_key_values=), or close() the cache first")
        self._fresh[layer] = False
        q = query[0]
        scaling = module.scaling if scaling is None else scaling
        t = q.shape[1]
        prompt = (t > 1 and not self._drafts) or self.layer_length(layer) == t
        if prompt:
            if layer == 0 and self.policy.adaptive:
                with self.changing():
                    self.compact()
            out = prefill_attention(self, layer, q, scaling)
        else:  # one new token, or a pass verifying drafted ones (``hooks.begin_forward``)
            out = self._decode(layer, q, scaling)
        self._after_attention(layer, decoding=not prompt)
        return out.transpose(0, 1).unsqueeze(0)

    # -- decode -------------------------------------------------------------------------
    def reserve(self, tag: str, nbytes: int) -> None:
        """Account ``nbytes`` of device memory under ``tag``, evicting cached chunks if needed,
        and for what is needed now (not a prefetch) cancelling other groups' prefetches, which
        are fetched again when their groups ask (``drop_prefetches``).

        TierFullError says what the device tier must hold for ``tag`` when it does not fit."""
        try:
            try:
                self.pipeline.cache.reserve(tag, nbytes)
            except TierFullError:
                if tag.startswith("prefetch:") or not self.drop_prefetches(tag):
                    raise
                self.pipeline.cache.reserve(tag, nbytes)
        except TierFullError as exc:
            raise TierFullError(f"{exc}: {device_need(tag, self.shape.token_bytes(1))}; raise "
                                "the device budget (TierConfig.device_budget, --device-budget)") from None

    def _decode(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        if layer == 0:
            self._new_step()
        block, spec = self.fetched(layer, self.policy.fetch(self, layer, q))
        positions = spec.positions
        wk, wv = self._window[layer]
        slot, n, w = self.slot_of[layer], positions.numel(), wk.shape[1]
        if isinstance(block, Scattered):
            parts = layer_parts(self._step, self.group_of[layer], block, spec.keep, slot, wk, wv)
            return self.policy.attend_parts(self, layer, q, parts, self._positions(layer, positions, w),
                                            scaling)
        k, v = block.keys[slot], block.values[slot]
        if spec.keep is not None:  # leaves smaller than their records: keep the leaves' tokens
            keep = spec.keep.to(k.device)
            k, v = torch.cat([k.index_select(1, keep), wk], dim=1), torch.cat(
                [v.index_select(1, keep), wv], dim=1)
        elif k.shape[1] >= n + w:  # the fetch left room for the window: no copy of the chunks
            k[:, n:n + w].copy_(wk)
            v[:, n:n + w].copy_(wv)
            k, v = k[:, :n + w], v[:, :n + w]
        else:
            k, v = torch.cat([k[:, :n], wk], dim=1), torch.cat([v[:, :n], wv], dim=1)
        return self.policy.attend(self, layer, q, k, v, self._positions(layer, positions, w),
                                  scaling)

    def _positions(self, layer: int, fetched: torch.Tensor, window: int) -> torch.Tensor:
        """The positions ``layer`` attends: ``fetched``'s, then the recent window's. The layers
        of a group share them within a step (read-only), so they are built once."""
        start = self.indexes[self.group_of[layer]].sealed
        held = self._held_positions
        if held is not None and held[0] is fetched and held[1] == (start, window):
            return held[2]
        positions = torch.cat([fetched, torch.arange(start, start + window)])
        self._held_positions = (fetched, (start, window), positions)
        return positions

    def _new_step(self) -> None:
        prefetched = {k: v for k, v in self._step.items() if k[0] == "prefetch"}
        for kind, group in self._step:
            if kind == "fetch":
                self.store.device.reserve(f"fetch:{group}", 0)
        self._step = prefetched
        self._chosen.clear()  # only a forward pass that failed part-way leaves any
        self.steps += 1
        self.metrics.step_begin()

    def spare_tokens(self, group: int) -> int:
        """Room left after a fetch of ``group`` for the recent window (which decode keeps
        below this)."""
        return self.select.window + self.record_tokens[group]

    def selection(self, group: int) -> Fetch | None:
        """What a filter layer chose for ``group`` this step, or None (all)."""
        return self._step.get(("select", group))

    def set_selection(self, group: int, fetch: Fetch) -> None:
        """Record what a filter layer chose for ``group``; its prefetch starts right after the
        choosing layer's attention, once that layer's own fetched records are let go (at 8K the
        filter layer's preselected candidates and the 12 layers after it would otherwise hold
        the device tier together)."""
        self._step[("select", group)] = fetch
        self._chosen.append(group)

    def in_background(self, group: int, fn, *args) -> None:
        """Run ``fn(*args)``, work on ``group``'s index that its layers do not read (a tree
        fold), on the cache's helper thread; waited for after the group's last layer."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._folds[group] = self.reader.submit(as_caller, stream,
                                                torch.is_inference_mode_enabled(), fn, *args)

    def compact(self) -> int:
        """Rewrite records to match merged/split chunks (idle work, never on the decode path);
        returns the number of records written."""
        check_open(self)
        keep = self.snapshot or frozenset()  # the saved document's records: until a save
        return sum(index.rewrite(self.store, keep) for index in self.indexes)

    def index_of(self, layer: int) -> GroupIndex:
        return self.indexes[self.group_of[layer]]

    def group_bytes(self, layer: int) -> int:
        """Bytes of the sealed KV of ``layer``'s group."""
        g = self.group_of[layer]
        return self.indexes[g].sealed * self.shape.token_bytes(len(self.groups[g]))

    def _importance(self, group: int) -> float:
        """Rank of the records ``group`` reads or seals now (see ``PINNED``); a group read whole
        while short, selectively once longer, unpins its records (they would hold the host)."""
        if self.policy.dense(self, self.groups[group][0]):
            self._pinned.add(group)
            return PINNED
        if group in self._pinned:
            self._pinned.discard(group)
            for key in self.indexes[group].keys:
                with contextlib.suppress(KeyError):  # sealed, not yet stored: put at this rank
                    self.store.set_importance(key, float(self.steps))
        return float(self.steps)

    # -- sealing ------------------------------------------------------------------------
    def _look_ahead(self, g: int, early: bool = False) -> None:
        """Prefetch group ``g`` when what it reads is known before its query (``Policy.ahead``:
        a dense layer's whole KV, ``tierkv``'s candidates ranked by the layer's last query).

        ``early``: the group before ``g`` has just been delivered and is about to compute; the
        prefetch starts now only if the device tier has room for it beside what the recent
        windows may still take this step (else it waits for the end of that group, as usual),
        so its transfer hides behind a whole group's compute.
        """
        known, wanted = self.policy.ahead(self, self.groups[g][0])
        if known:
            spec = self.indexes[g].fetch(wanted)
            room = self.fetch_room(g)  # a group read whole past it: the step refuses (check_room)
            if room is None or spec.tokens <= room:
                self.prefetch(g, spec)  # if the windows may still grow beside it
        if g == 0 and not early:
            self.metrics.step_end()

    def _room(self) -> float:
        """Device-tier bytes a reservation could take now (free plus evictable cached records)."""
        tier = self.store.device
        if tier.budget is None:
            return float("inf")
        return tier.budget - tier.used + self.pipeline.cache.used

    def _after_attention(self, layer: int, decoding: bool) -> None:
        """Move ``layer``'s sealable window tokens to host; seal the group after its last layer."""
        g = self.group_of[layer]
        step = self.record_tokens[g]
        movable = (self._window[layer][0].shape[1] - self.select.window) // step * step
        last = layer == self.groups[g][-1]
        if movable > 0 or (last and g in self._folds):
            with self.changing():
                if movable > 0:
                    self._pending[layer].append(self._window.cut(layer, movable))
                if last and g in self._folds:
                    self._folds.pop(g).result()
        if last and self._step.pop(("fetch", g), None) is not None:
            self._step.pop(("table", g), None)  # a Scattered fetch's records: let go too
            self.store.device.reserve(f"fetch:{g}", 0)
        for chosen in self._chosen:
            self.prefetch(chosen, self._step[("select", chosen)])
        self._chosen.clear()
        if last and self._pending[self.groups[g][0]]:
            seal(self, g)
        if last and decoding:
            self._look_ahead((g + 1) % len(self.groups))

    # -- lifetime -----------------------------------------------------------------------
    def save(self, path) -> Path:
        """Store this document (records, indexes, windows, token ids) under directory ``path``,
        to be reopened by ``TieredCache.open`` in this or another process."""
        from .persist import save

        return save(self, path)

    @classmethod
    def open(cls, model, path, config: TierConfig | None = None, policy: str | None = None,
             doc: str | None = None, select: SelectConfig | None = None,
             profile: dict | None = None) -> "TieredCache":
        """Reopen a saved document for ``model`` (checked to be the model that saved it), with
        the policy, selection and profile it was saved with unless given.

        The next ``generate`` continues the saved sequence: pass ``cache.token_ids`` followed by
        the new tokens as its input ids.
        """
        from .persist import open_cache

        return open_cache(cls, model, path, config, policy, doc, select, profile)

    def close(self) -> None:
        """Give the model back its own attention and release the tiers (idempotent)."""
        if self._model is None:
            return
        if self._in_forward and self._thread == threading.get_ident():  # a pass stopped by
            restore(self)  # what skipped ``end_forward``
        self._held.release()
        uninstall(self)
        self.reader.shutdown(wait=True, cancel_futures=True)
        self.prefill_staged = self.prefill_ahead = None
        self._kept.clear()
        self.pipeline.close()
        disk = self.store.disk
        try:  # records written since the saved state, which stays as it was saved, or all of a
            # new document never saved here (no reopening reaches them); their space back
            unsaved = self._new_doc and disk is not None and self.doc not in disk.saved_docs()
            if disk is not None and (self.snapshot is not None or unsaved):
                keep = self.snapshot or ()
                if disk.remove_many([k for k in disk.keys() if k.doc == self.doc and k not in keep]):
                    disk.reclaim()
        finally:
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        """Tokens, tier occupancy and the device tier's peak, as a dict."""
        return {"tokens": self.get_seq_length(), "policy": self.policy.name,
                "device_peak_bytes": self.store.device.peak, **self.store.stats(),
                "trimmed_fetches": self.trimmed_fetches, "trimmed_tokens": self.trimmed_tokens,
                **{f"pipeline_{k}": v for k, v in self.metrics.summary().items()}}
