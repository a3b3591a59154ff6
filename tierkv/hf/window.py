"""Each layer's recent window: the newest keys and values, not yet sealed into records.

A decode step appends one token a layer. Growing the window by ``torch.cat`` copied it whole and
accounted its new size with the device tier on every step, for every layer: ~1.9 ms of a step
at 8K on the 2-core CPU (line profiler, 32 steps, 30 layers). Here a layer's window lives in a
buffer with room for what decode adds before the window is next cut (``capacity``, the cache's
``spare_tokens``), reserved once: a step writes its token in place.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..storage.base import KVBlock

Reserve = Callable[[str, int], None]  # TieredCache.reserve: account device bytes under a tag


class RecentWindows:
    """The recent windows of ``len(capacity)`` layers; ``windows[layer]`` is (keys, values),
    each of shape (kv_heads, n, head_dim) on ``device``.

    A window is a prefix of its layer's buffer (``room``) when it has one; buffers are reserved
    with ``reserve`` under ``window:<layer>`` at their full size. ``capacity[layer]``: the tokens
    a layer's window grows to in decode before it is next cut (the cache's ``spare_tokens``).
    """

    def __init__(self, capacity: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, reserve: Reserve):
        empty = torch.zeros(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self._windows = [(empty, empty) for _ in capacity]
        self._rooms: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(capacity)
        self._capacity = list(capacity)
        self._reserve = reserve
        self._most: tuple | None = None  # (buffers made, extra, most_bytes(extra)) last summed
        self._made = 0  # buffers made or replaced so far

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows[layer]

    def __setitem__(self, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Replace ``layer``'s window (a reopened document's); the caller accounts its bytes."""
        self._windows[layer] = kv
        self._rooms[layer] = None
        self._made += 1

    def __iter__(self):
        return iter(self._windows)

    def __len__(self) -> int:
        return len(self._windows)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values``, shape (kv_heads, t, head_dim), to ``layer``'s window.

        Written in place while the buffer has room; otherwise a new buffer of ``max(n + t,
        capacity[layer])`` tokens (``n + t`` when t > 1: a prompt's window is cut right after) is
        reserved first (TierFullError changes nothing) and the window copied into it."""
        k, v = self._windows[layer]
        n, t = k.shape[1], keys.shape[1]
        room = self._rooms[layer]
        if room is None or n + t > room[0].shape[1] or (
                room[0].is_inference() and not torch.is_inference_mode_enabled()):
            # (a buffer made under torch.inference_mode may be written only under it)
            tokens = n + t if t > 1 else max(n + t, self._capacity[layer])
            room = self._allocate(layer, k, v, tokens)
        room[0][:, n:n + t].copy_(keys)
        room[1][:, n:n + t].copy_(values)
        self._windows[layer] = (room[0][:, :n + t], room[1][:, :n + t])

    def cut(self, layer: int, tokens: int) -> KVBlock:
        """Take ``layer``'s first ``tokens`` window tokens out, as a block on the CPU; the rest
        moves to a new buffer of ``capacity[layer]`` tokens (at least the rest), so the taken
        tokens' memory is never written again (on a CPU the block is a view of it, not a copy)."""
        k, v = self._windows[layer]
        taken = KVBlock(k[:, :tokens].cpu(), v[:, :tokens].cpu())
        rest_k, rest_v = k[:, tokens:], v[:, tokens:]
        room = self._allocate(layer, rest_k, rest_v, max(rest_k.shape[1], self._capacity[layer]))
        self._windows[layer] = (room[0][:, :rest_k.shape[1]], room[1][:, :rest_k.shape[1]])
        return taken

    def shortest(self) -> int:
        """Tokens the shortest window holds."""
        return min(k.shape[1] for k, _ in self._windows)

    def drop_last(self, layer: int, tokens: int) -> None:
        """Take ``layer``'s newest ``tokens`` out of its window (``crop``): the buffer stays,
        with room for what comes next."""
        k, v = self._windows[layer]
        self._windows[layer] = (k[:, :k.shape[1] - tokens], v[:, :v.shape[1] - tokens])

    def put_back(self, layer: int, cut: list[KVBlock], tokens: int) -> None:
        """Make ``layer``'s window the first ``tokens`` of the blocks ``cut`` from it since its
        group last sealed, followed by the window: a failed forward pass undone
        (``recover.roll_back``). Its buffer is as an append leaves it, ``max(tokens,
        capacity[layer])`` tokens, so a prompt's larger one is let go."""
        k, v = self._windows[layer]
        if not cut and k.shape[1] == tokens:  # a layer the pass did not reach
            return
        if cut:
            k = torch.cat([block.keys.to(k.device) for block in cut] + [k], dim=1)
            v = torch.cat([block.values.to(v.device) for block in cut] + [v], dim=1)
        k, v = k[:, :tokens], v[:, :tokens]
        size, room = max(tokens, self._capacity[layer]), self._rooms[layer]
        if cut or room is None or room[0].shape[1] != size:
            room = self._allocate(layer, k, v, size)
        self._windows[layer] = (room[0][:, :tokens], room[1][:, :tokens])

    def held_bytes(self, layer: int) -> int:
        """Device bytes ``layer``'s window holds: its buffer's, or the window's own."""
        room = self._rooms[layer]
        k, v = self._windows[layer] if room is None else room
        return k.nbytes + v.nbytes

    def growth(self, extra: int = 0) -> int:
        """Device bytes the windows may still reserve before they are next cut, each growing to
        its ``capacity`` (and ``extra`` tokens more: a pass verifying drafted tokens)."""
        return sum(max(0, self._full_bytes(layer, extra) - self.held_bytes(layer))
                   for layer in range(len(self._capacity)))

    def most_bytes(self, extra: int = 0) -> int:
        """Device bytes the windows hold at most before they are next cut: each layer's buffer
        at its ``capacity`` (and ``extra`` tokens more: a pass verifying drafted tokens appends
        them beyond a decode step's one), or what it holds when more (a reopened document's
        window, kept at its saved length)."""
        if self._most is None or self._most[:2] != (self._made, extra):
            self._most = self._made, extra, sum(max(self._full_bytes(layer, extra),
                                                    self.held_bytes(layer))
                                                for layer in range(len(self._capacity)))
        return self._most[2]

    def _full_bytes(self, layer: int, extra: int = 0) -> int:
        """Device bytes of ``layer``'s buffer at its ``capacity`` and ``extra`` tokens."""
        k = self._windows[layer][0]
        return 2 * k.shape[0] * (self._capacity[layer] + extra) * k.shape[2] * k.element_size()

    def _allocate(self, layer: int, k: torch.Tensor, v: torch.Tensor, tokens: int):
        """A new buffer of ``tokens`` tokens holding ``k``/``v`` first, reserved before it is
        made (TierFullError leaves the window as it was)."""
        heads, _, dim = k.shape
        self._reserve(f"window:{layer}", 2 * heads * tokens * dim * k.element_size())
        room = (torch.empty(heads, tokens, dim, dtype=k.dtype, device=k.device),
                torch.empty(heads, tokens, dim, dtype=v.dtype, device=v.device))
        room[0][:, :k.shape[1]].copy_(k)
        room[1][:, :v.shape[1]].copy_(v)
        self._rooms[layer] = room
        self._made += 1
        return room
