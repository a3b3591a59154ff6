"""The fetch plan of one decode step: which records each layer group needs, in compute order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from tierkv.storage.base import RecordKey


@dataclass(frozen=True)
class GroupFetch:
    """The records of one layer group, in the order their tokens are concatenated.

    ``importance`` holds one value per key (higher = hotter); it drives the device cache.
    ``position`` is the group's index in its plan (0: fetched first, with nothing to overlap).
    ``spare`` tokens of uninitialised room follow the records in the delivered block.
    ``packed`` False: on a CPU the records are delivered as they are held (``Scattered``).
    """

    group: int
    keys: tuple[RecordKey, ...]
    importance: tuple[float, ...]
    position: int
    spare: int = 0
    packed: bool = True


class FetchPlan:
    """An ordered list of ``(layer group, record keys)`` for one decode step.

    Groups are fetched in the order given (the order the model computes them). Duplicate keys in
    a group are dropped, keeping the first occurrence: a chunk selected twice must still be
    attended once. A key of another group, a group listed twice, a group with no keys or a
    negative group raise ``ValueError`` here; groups beyond the store's range raise at
    ``Pipeline.submit``; keys the store does not hold surface from ``StepHandle.wait`` of their
    group.

    Parameters
    ----------
    groups : iterable of (group, sequence of RecordKey)
    importance : optional mapping RecordKey -> float; keys not in it get ``default_importance``.
    default_importance : float, importance of keys without a value.
    spare : tokens of room left after each group's records in its delivered block, for the
        consumer to append its recent window without copying the fetched tokens again.
    packed : False to have a CPU deliver each group's records as they are held, unpacked
        (``scattered.Scattered``), for a consumer that reads them in place; CUDA always packs.
    """

    def __init__(self, groups: Iterable[tuple[int, Sequence[RecordKey]]],
                 importance: Mapping[RecordKey, float] | None = None,
                 default_importance: float = 0.0, spare: int = 0, packed: bool = True):
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise ValueError(f"FetchPlan: spare={spare!r} must be a non-negative integer")
        importance = dict(importance or {})
        self._groups: list[GroupFetch] = []
        seen: set[int] = set()
        for entry in groups:
            group, keys = _unpack(entry)
            if group in seen:
                raise ValueError(f"FetchPlan: group {group} is listed twice")
            seen.add(group)
            unique = _dedupe(group, keys)
            weights = tuple(float(importance.get(k, default_importance)) for k in unique) \
                if importance else (float(default_importance),) * len(unique)
            if any(w != w for w in weights):  # NaN would scramble the device cache's ranking
                raise ValueError(f"FetchPlan: group {group}: an importance is NaN")
            self._groups.append(GroupFetch(group, unique, weights, len(self._groups), spare,
                                           bool(packed)))

    @property
    def groups(self) -> tuple[GroupFetch, ...]:
        return tuple(self._groups)

    def group_ids(self) -> list[int]:
        return [g.group for g in self._groups]

    def keys(self) -> list[RecordKey]:
        """Every key of the plan, in plan order."""
        return [k for g in self._groups for k in g.keys]

    def check_groups(self, n_groups: int) -> None:
        """Raise ValueError naming the first group outside ``[0, n_groups)``."""
        for g in self._groups:
            if g.group >= n_groups:
                raise ValueError(f"FetchPlan: group {g.group} is out of range: the store has "
                                 f"{n_groups} layer groups (0..{n_groups - 1})")

    def __len__(self) -> int:
        return len(self._groups)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{g.group}:{len(g.keys)}" for g in self._groups)
        return f"FetchPlan({sizes})"


def _unpack(entry) -> tuple[int, Sequence[RecordKey]]:
    try:
        group, keys = entry
    except (TypeError, ValueError):
        raise ValueError(f"FetchPlan: expected (group, keys) pairs, got {entry!r}") from None
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ValueError(f"FetchPlan: group={group!r} must be a non-negative integer")
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ValueError(f"FetchPlan: keys of group {group} must be a sequence of RecordKey")
    return group, keys


def _dedupe(group: int, keys: Sequence[RecordKey]) -> tuple[RecordKey, ...]:
    if not keys:
        raise ValueError(f"FetchPlan: group {group} has no keys: leave the group out of the plan")
    try:
        unique = tuple(dict.fromkeys(keys))
    except TypeError:  # unhashable: named below
        unique = tuple(keys)
    wrong = [key for key in unique if not isinstance(key, RecordKey) or key.group != group]
    if wrong:
        key = wrong[0]
        if not isinstance(key, RecordKey):
            raise ValueError(f"FetchPlan: group {group}: {key!r} is not a RecordKey")
        raise ValueError(f"FetchPlan: {key} belongs to group {key.group}, listed under {group}")
    return unique
