"""What a decode step brings up for a layer group: ``TieredCache``'s fetches (a mixin).

A group's records are fetched once a step: prefetched while the layers before it compute when
they are known early (``TieredCache._look_ahead``, ``set_selection``), else in the decoding
thread when its first layer asks (``fetched``). Their bytes count against the device tier
from the request on (``prefetch:<group>``, then ``fetch:<group>`` until the group's last layer).

What a step fetches fits the device tier beside every layer's recent window: a selection is
cut to the room there is (``fit_to_device``), a group read whole that outgrew it is refused
before the step begins (``check_room``), and a prefetch for later layers gives way to a fetch
needed now.
"""
from __future__ import annotations

import warnings

import torch

from ..pipeline import FetchPlan
from ..scattered import Scattered
from ..storage.base import DeviceBudgetWarning, KVBlock, TierFullError
from .groups import Fetch


class GroupFetches:
    """``TieredCache``'s fetch of a layer group's records for a decode step (its state lives in
    the cache: ``_step``, ``_kept``, ``pipeline``, ``store``)."""

    _drafts = 0  # the tokens a verifying pass adds to each window beyond a step's one (``hooks``)

    def fetched(self, layer: int, wanted: Fetch | torch.Tensor | None):
        """The records of ``layer``'s group that ``wanted`` names (a Fetch, leaf indices, or None
        for all) on the device, once per step per group: (KVBlock of the records, Fetch).

        A group that preselects (its records known from its query only) and reads them in place
        keeps them to its next step, where the same records, as most steps ask (sticky
        candidates), are not fetched again: a worker ranks them as read. At 8K on the CPU, 9 of
        10 such fetches, ~0.9 ms each for a filter layer; one cache decoding alternate blocks
        of 8 steps with and without (2026-11-28): 85.2 against 89.0 ms a token (median 84.2
        against 87.4). Between steps a kept block holds the tiers' own records (ranked as
        read, so they stay) and the decoded copies of any that were read from disk for it:
        memory the device tier does not count outside a step."""
        g = self.group_of[layer]
        spec = wanted if isinstance(wanted, Fetch) else self.indexes[g].fetch(wanted)
        hit = self._step.get(("fetch", g))
        if hit is not None and hit[0] == spec.keys:
            return hit[1], spec
        if not spec.keys:
            empty = torch.zeros(len(self.groups[g]), self.shape.kv_heads, 0, self.shape.head_dim,
                                dtype=self.shape.dtype, device=self.device)
            return KVBlock(empty, empty), spec
        pending, kept = self._step.pop(("prefetch", g), None), self._kept.pop(g, None)
        if pending is not None and pending[0] != spec.keys:  # other records: not needed now
            pending[1].cancel()
            self.store.device.reserve(f"prefetch:{g}", 0)
            pending = None
        if pending is not None:
            block = pending[1].wait(g)
            self.store.device.reserve(f"prefetch:{g}", 0)
        elif kept is not None and kept[0] == spec.keys:
            block = kept[1]
            self.pipeline.refresh(self._plan(g, spec))
        else:  # known only now: fetched in this thread, which would only wait for it
            self.reserve(f"fetch:{g}", self._fetch_bytes(g, spec))
            block = self.pipeline.fetch_now(self._plan(g, spec))
        if isinstance(block, Scattered) and self.policy.preselects(self, layer):
            self._kept[g] = (spec.keys, block)
        self.reserve(f"fetch:{g}", block.nbytes)
        self._step[("fetch", g)] = (spec.keys, block)
        if len(self.groups) > 1:
            self._look_ahead((g + 1) % len(self.groups), early=True)
        return block, spec

    def prefetch(self, group: int, spec: Fetch) -> None:
        """Start bringing ``spec``'s records of ``group`` to the device (pipelined, in flight
        while earlier layers compute); its bytes count against the device budget from now.
        Not when the device tier has no room for them now beside what the recent windows may
        still take this step (another group's prefetch holds it: ``full_after_filter``'s dense
        layer and the choice for the layers after it; a reopened document's windows, not yet
        grown): the group then fetches them when its first layer asks."""
        if not spec.keys or self._step.get(("prefetch", group), (None,))[0] == spec.keys:
            return
        nbytes = self._fetch_bytes(group, spec)
        if self._room() < nbytes + self._window.growth(self._drafts):
            return
        self.reserve(f"prefetch:{group}", nbytes)
        self._step[("prefetch", group)] = (spec.keys, self.pipeline.submit(self._plan(group, spec)))

    def drop_prefetches(self, tag: str) -> bool:
        """Cancel the prefetches of groups other than ``tag``'s (``fetch:<group>``, a window's, a
        prefill's) and let their bytes go: what is needed now comes before what is fetched
        ahead. Whether any was dropped."""
        kind, _, name = tag.partition(":")
        own = int(name) if kind == "fetch" else None
        later = [key for key in self._step if key[0] == "prefetch" and key[1] != own]
        for key in later:
            self._step.pop(key)[1].cancel()
            self.store.device.reserve(f"prefetch:{key[1]}", 0)
        return bool(later)

    def _plan(self, group: int, spec: Fetch) -> FetchPlan:
        return FetchPlan([(group, spec.keys)], spare=self.spare_tokens(group),
                         default_importance=self._importance(group), packed=not self.in_place)

    def _fetch_bytes(self, group: int, spec: Fetch) -> int:
        """Device bytes a fetch of ``spec`` for ``group`` takes, with room for the window."""
        tokens = spec.tokens + self.spare_tokens(group)
        return tokens * self.shape.token_bytes(len(self.groups[group]))

    def fetch_room(self, group: int) -> int | None:
        """Tokens of ``group``'s sealed KV that one fetch can bring to the device tier beside
        every layer's recent window (``spare_tokens`` each, or what a reopened one holds,
        ``RecentWindows.most_bytes``) and the fetch's own room for the group's window
        (``_fetch_bytes``); None when the tier has no budget.

        A group's fetch is on the device with no other group's but a prefetch that found room
        for itself (``TieredCache._look_ahead``), and a filter layer's choice is fetched once
        the filter layer's own records are let go (``set_selection``)."""
        budget = self.store.device.budget
        if budget is None:
            return None
        return max(0, self._room_short(group, budget))

    def _room_short(self, group: int, budget: int) -> int:
        """``fetch_room`` before it is held at 0: negative when even the window room the
        fetch keeps for ``group`` does not fit."""
        per_token = self.shape.token_bytes(len(self.groups[group]))
        windows = self._window.most_bytes(self._drafts)  # a verifying pass's drafts too
        return (budget - windows) // per_token - self.spare_tokens(group)

    def _budget_for(self, group: int, tokens: int) -> int:
        """The device budget whose ``fetch_room(group)`` is at least ``tokens``."""
        budget = self.store.device.budget
        short = tokens - self._room_short(group, budget)
        return budget + max(0, short) * self.shape.token_bytes(len(self.groups[group]))

    def fit_to_device(self, group: int, tokens: int, count: bool = True) -> int:
        """``tokens``, what a policy would have a decode step fetch of ``group``, or as many as
        the device tier holds (``fetch_room``) when fewer: the policy then fills that much (its
        lowest-ranked chunks stay behind) and the step goes on. Such fetches are counted
        (``stats()["trimmed_fetches"]``, ``"trimmed_tokens"``); the first one warns
        (DeviceBudgetWarning) with the device budget that holds them all. ``count=False``: a
        guess at a fetch (a prefill's), cut alike but not counted."""
        room = self.fetch_room(group)
        wanted = min(tokens, self.indexes[group].sealed)  # a fetch brings no more than that
        if room is None or wanted <= room:
            return tokens
        if not count:
            return room
        self.trimmed_fetches += 1
        self.trimmed_tokens += wanted - room
        if self.trimmed_fetches == 1:
            layers = self.groups[group]
            need = self._budget_for(group, wanted)
            warnings.warn(
                f"the device tier ({self.store.device.budget} B) holds {room} tokens of layer group "
                f"{group} (layers {_span(layers)}) beside the recent windows, fewer than the "
                f"{wanted} that policy {self.policy.name!r} would fetch at {self.get_seq_length()} "
                f"tokens: its fetches attend what fits (counted in stats()['trimmed_fetches']); "
                f"a device budget of {need} B holds them all (TierConfig.device_budget, "
                "--device-budget)", DeviceBudgetWarning, stacklevel=2)
        return room

    def check_room(self) -> None:
        """Before a decode step changes anything: TierFullError when the device tier no longer
        holds, beside the recent windows, what a layer group must bring whatever it selects:
        every sealed token of a group its policy reads whole, or the records holding the sink
        tokens of any other. Raised from the step's middle instead, it would leave the cache
        unable to go on or be saved; refused here, the cache stays whole. The error names the
        first such group and the device budget that holds every group's least."""
        first, need = None, 0
        for g, layers in enumerate(self.groups):
            room = self.fetch_room(g)
            sealed = self.indexes[g].sealed
            if room is None or sealed <= room:
                continue
            dense = self.policy.dense(self, layers[0])
            if dense:
                least = sealed
            else:  # whatever it selects, the records holding the sinks come first
                cuts = self.indexes[g].tree.record_cuts
                sinks = min(self.select.sinks, sealed)
                least = int(cuts[torch.searchsorted(cuts, sinks)]) if sinks else 0
            if least <= room:
                continue
            need = max(need, self._budget_for(g, least))
            if first is None:
                where = f"layer group {g} (layers {_span(layers)})"
                first = (f"reads {where} whole under policy {self.policy.name!r}: its {sealed} "
                         "sealed tokens" if dense else
                         f"brings {where}'s sink tokens under policy {self.policy.name!r}: the "
                         f"{least} tokens of their records"), room
        if first is None:
            return
        other = "choose a policy that selects (tierkv)" if self.policy.name != "tierkv" \
            else f"keep smaller recent windows (SelectConfig.window={self.select.window})"
        raise TierFullError(
            f"a decode step {first[0]} do not fit the device tier ({self.store.device.budget} B) "
            f"beside the recent windows, which holds {first[1]}. Nothing was changed: save the "
            f"cache (save()) and reopen it (TieredCache.open) with a device budget of at least "
            f"{need} B, or {other}")

    def check_prompt_room(self, new: int) -> None:
        """Before a prompt of ``new`` tokens is fed to a cache that holds some: TierFullError
        when a layer's prefill cannot fit the device tier, which holds, while that layer
        attends, its whole sealed context and its window with the prompt beside the other
        layers' windows (counted as now reserved: the least they take). Raised from the pass's
        middle instead, it would leave the cache unable to go on or be saved."""
        device = self.store.device
        if device.budget is None:
            return
        per_token = self.shape.token_bytes(1)
        windows = [device.reserved_for(f"window:{layer}") for layer in range(self.shape.layers)]
        others, worst = sum(windows), None
        for layer in range(self.shape.layers):
            tokens = self.indexes[self.group_of[layer]].sealed + self._window[layer][0].shape[1] + new
            need = others - windows[layer] + tokens * per_token
            if need > device.budget and (worst is None or need > worst[0]):
                worst = need, layer, tokens
        if worst is not None:
            need, layer, tokens = worst
            raise TierFullError(
                f"a prompt of {new} tokens is prefilled one layer at a time, and layer {layer} "
                f"would hold its {tokens} tokens of context on the device beside the other "
                f"layers' recent windows: {need} B, more than the device tier's {device.budget} "
                "B. Nothing was changed: save the cache (save()) and reopen it "
                f"(TieredCache.open) with a device budget of at least {need} B")


def _span(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
