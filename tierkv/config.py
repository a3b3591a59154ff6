"""Frozen, validated configuration objects.

Every value from a user passes through here once; a bad value raises ``ValueError`` naming the
field, the value and what is allowed, at construction, before anything is stored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import psutil

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, field_name: str = "size") -> int:
    """Bytes from an int or a string such as ``"64MB"``, ``"1.5GiB"``, ``"512k"``.

    ``KB/MB/GB/TB`` are decimal (10**3...), ``KiB/MiB/GiB/TiB`` and the bare ``K/M/G/T`` binary.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field_name}={value!r}: expected a byte count or a size like '64MB'")
    if isinstance(value, int):  # exact: a float would round past 2**53, and overflow
        if not 0 <= value <= 2**62:
            shown = value if len(str(value)) <= 24 else f"{str(value)[:12]}... ({len(str(value))} digits)"
            raise ValueError(f"{field_name}={shown}: must be between 0 and 2**62 bytes")
        return value
    if isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{field_name}={value!r}: expected a size like '64MB', '1.5GiB' or "
                             f"an integer byte count (units: KB MB GB TB KiB MiB GiB TiB)")
        number, unit = float(match.group(1)), match.group(2).lower()
        if not unit and match.group(1).isdigit():
            return parse_size(int(match.group(1)), field_name)
    else:
        raise ValueError(f"{field_name}={value!r}: expected int or str, got {type(value).__name__}")
    size = number * _UNITS[unit]
    if size < 0 or size != size or size > 2**62:
        raise ValueError(f"{field_name}={value!r}: must be between 0 and 2**62 bytes")
    if not unit and not number.is_integer():
        raise ValueError(f"{field_name}={value!r}: a byte count must be a whole number "
                         "(or give a unit, e.g. '0.5GB')")
    if 0 < size < 1:
        raise ValueError(f"{field_name}={value!r} is {size:g} bytes: less than one byte "
                         "(0 for none)")
    return int(size)


def _check_range(name: str, value, low, high, kind=int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"{name}={value!r}: expected {kind.__name__} in [{low}, {high}]")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r}: must be in [{low}, {high}]")


def check_direct_io(value) -> None:
    """``direct_io`` (``TierConfig``, ``DiskTier``) is "auto", True or False."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"direct_io={value!r}: expected 'auto', True or False")


CODECS = ("raw", "zstd", "int8", "int4")
LOSSY_CODECS = ("int8", "int4")


@dataclass(frozen=True)
class CodecConfig:
    """How records are encoded on disk.

    ``codec="auto"`` lets the compression controller choose per record from measured bandwidths,
    within ``allow_lossy``; a named codec fixes it. With ``allow_lossy`` the controller may give
    a lossy codec to cold records only: the ``cold_fraction`` least important of the records a
    store holds. Ties count as hot: when every record has the same importance (nobody ranked
    them), none is cold unless ``cold_fraction`` is 1.
    """

    codec: str = "auto"
    zstd_level: int = 3
    allow_lossy: bool = False
    group_size: int = 64
    cold_fraction: float = 0.5

    def __post_init__(self):
        allowed = ("auto",) + CODECS
        if self.codec not in allowed:
            raise ValueError(f"codec={self.codec!r}: must be one of {', '.join(allowed)}")
        if not isinstance(self.allow_lossy, bool):
            raise ValueError(f"allow_lossy={self.allow_lossy!r}: expected True or False")
        if self.codec in LOSSY_CODECS and not self.allow_lossy:
            raise ValueError(f"codec={self.codec!r} is lossy: set allow_lossy=True to use it")
        _check_range("zstd_level", self.zstd_level, 1, 22)
        _check_range("group_size", self.group_size, 8, 4096)
        _check_range("cold_fraction", self.cold_fraction, 0.0, 1.0, float)
        if self.group_size % 2:
            raise ValueError(f"group_size={self.group_size}: must be even (int4 packs pairs)")

    @property
    def candidates(self) -> tuple[str, ...]:
        """Codecs the controller may choose from."""
        if self.codec != "auto":
            return (self.codec,)
        return CODECS if self.allow_lossy else ("raw", "zstd")


@dataclass(frozen=True)
class TierConfig:
    """Budgets and places of the three tiers.

    Parameters
    ----------
    device_budget : bytes of KV the device tier may hold (int or "64MB").
    host_budget : bytes of KV the host tier may hold; ``None`` takes half of the memory psutil
        reports available now.
    disk_dir : directory of the disk tier; ``None`` means no disk tier (host overflow is an error).
    device : "auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N".
    io_threads : reader threads of the disk tier.
    direct_io : "auto", True or False: whether the disk tier reads with O_DIRECT, bypassing the
        page cache ("auto": while its records outgrow the machine's available memory; see
        ``DiskTier``).
    """

    device_budget: int | str = "256MB"
    host_budget: int | str | None = None
    disk_dir: str | Path | None = None
    disk_budget: int | str | None = None
    device: str = "auto"
    io_threads: int = 4
    direct_io: bool | str = "auto"
    segment_size: int | str = "256MiB"
    codec: CodecConfig = field(default_factory=CodecConfig)

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "device_budget", parse_size(self.device_budget, "device_budget"))
        host = self.host_budget
        if host is None:
            host = psutil.virtual_memory().available // 2
        set_(self, "host_budget", parse_size(host, "host_budget"))
        if self.disk_budget is not None:
            set_(self, "disk_budget", parse_size(self.disk_budget, "disk_budget"))
        set_(self, "segment_size", parse_size(self.segment_size, "segment_size"))
        if not 4096 <= self.segment_size <= 2**40:
            raise ValueError(f"segment_size={self.segment_size}: must be in [4KiB, 1TiB]")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, Path)) or str(self.disk_dir) == "":
                raise ValueError(f"disk_dir={self.disk_dir!r}: expected a directory path")
            set_(self, "disk_dir", Path(self.disk_dir))
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        _check_range("io_threads", self.io_threads, 1, 256)
        check_direct_io(self.direct_io)
        if not isinstance(self.codec, CodecConfig):
            raise ValueError(f"codec={self.codec!r}: expected a CodecConfig")

    @property
    def torch_device(self):
        """The torch.device of the device tier (CPU memory when no CUDA is present)."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}: CUDA is not available on this machine")
        return torch.device(self.device)


@dataclass(frozen=True)
class ChunkConfig:
    """Sizes and adaptation rules of the chunk tree (IAKM).

    Leaves hold between ``min`` and ``max`` tokens; sealing cuts ``base``-token chunks, one
    stored record each. A leaf whose EMA attention share stays below ``desert_threshold`` x its
    uniform share for ``merge_after`` evaluations merges with a cold neighbour; a selected leaf
    whose mass sits ``split_concentration`` or more in one half splits, down to ``min`` tokens.
    Records follow merges and splits when the store is idle, but never below ``base`` tokens:
    smaller leaves share a record, and a fetch keeps only the chosen leaves' tokens of it.

    The defaults seal 8-token chunks and let the attention split them down to 2 tokens: on
    SmolLM2 (``bench.selection``, 10 % budget, 2K-8K tokens) the summaries alone then capture
    0.92-0.96 of the exact top-k tokens' mass, against 0.84-0.92 with 8-token leaves, while
    records stay 8 tokens (no more reads or copies per step than 8-token leaves).
    """

    min: int = 2
    base: int = 8
    max: int = 512
    desert_threshold: float = 0.2
    merge_after: int = 4
    split_concentration: float = 0.8
    ema: float = 0.5

    def __post_init__(self):
        _check_range("min", self.min, 1, 1 << 20)
        _check_range("base", self.base, self.min, 1 << 20)
        _check_range("max", self.max, self.base, 1 << 24)
        _check_range("desert_threshold", self.desert_threshold, 0.0, 1.0, float)
        _check_range("merge_after", self.merge_after, 1, 1000)
        _check_range("split_concentration", self.split_concentration, 0.5, 1.0, float)
        _check_range("ema", self.ema, 0.0, 1.0, float)


SELECTORS = ("last", "uniform", "exp")
FETCH_UNITS = ("record", "leaf")
MAX_BUDGET_TOKENS = 1 << 40  # far past any context, and within torch's int64 arithmetic
# A question's probabilities are held a kv head and a block of its queries at a time
# (``attention.attention_with_mass``): at most 64 MB of fp32 scores whatever the context (twice
# that at the softmax).
MAX_QUESTION_TOKENS = 256


@dataclass(frozen=True)
class SelectConfig:
    """What a sparse layer attends to.

    ``budget`` is the token budget of the selected context: a fraction of the context length
    when a float up to 1.0 (0.1; 1.0, the whole context), a token count when an int >= 1 or a
    whole float above 1 (``budget=1.0`` read as one token took a user meaning "all of it" to
    sinks and window only). Sinks and the recent window are always kept and count against it.

    ``fetch_unit`` is what ``omnikv``/``tierkv`` fill the budget with from a filter layer's
    scores: ``"record"`` (default), whole stored records (``ChunkConfig.base`` tokens), so a
    leaf split below its record brings the record; or ``"leaf"``: the selecting groups' records
    are sealed as leaves of ``ChunkConfig.min`` tokens, the budget is filled with single leaves
    (while the records they bring stay within ``omnikv.LEAF_MOVE_FACTOR`` = 1.5 x the budget),
    and attention reads only their tokens of the records fetched. Finer choice, but records are
    read and moved whole. On SmolLM2:

    * 8K decode, 64 steps (``bench.decode --cases tierkv --fetch-unit leaf``): top-1 agreement
      0.953 against 0.922, for 9.6 MB read from disk per token against 3.45 and a device peak
      of 27.3 MB against 18.9.
    * 2K/4K/8K contexts, 64 teacher-forced tokens each, device tier 4x ``bench.quality``'s:
      top-1 0.870 against 0.859 at a 10 % budget, 0.818 against 0.766 at 5 %.
    * Four seeded 8K documents, ``bench.decode``'s case teacher-forced (2026-11-29), device tier
      7 % of the KV for both: KL from full attention 0.062 against 0.076, top-1 0.883 both, a
      step ~10 % slower. At 5 %, where the leaves' records are cut to what the device tier holds
      (``TieredCache.fit_to_device``; before, ``TierFullError``): KL 0.070, top-1 0.891, median
      step 84-91 against 78-80 ms. With the records held to 1.0x the budget: KL 0.078, 0.875.

    ``full_after_filter``: the layer right after each filter layer attends its whole context
    (OmniKV's way to hide the selection's load). Same four documents, device 25 % / host 50 %
    of the KV: KL 0.068 against 0.076, top-1 0.879 against 0.883, a step ~30 % slower (median
    77-80 against 60-63 ms). At 5 % / 20 %, where the choice for the layers after it now waits
    for the dense layer's fetch instead of both failing to fit (``TierFullError`` before): KL
    0.060, top-1 0.898, a step ~45 % slower (median 98-120 against 78-80 ms). The gain is the
    last filter layer's (a patch outside the package): layer 18 alone read densely, KL 0.060,
    top-1 0.898; layer 3 alone, KL 0.075, 0.879; with the device at 7 % so that layer 18's
    fetch and the choice for 19-29 fit together, seed 0 took 110 against 92 ms a step.

    ``question_tokens``: a prompt of 2 to this many tokens fed to a cache that holds context (a
    question to a long or saved document) attends through ``omnikv``'s and ``tierkv``'s
    selection, as a decode step does, its queries choosing together, with
    ``omnikv.QUESTION_BUDGET_FACTOR`` x the budget (``Policy.question_fetch``): it reads the
    chosen records, not the whole KV. Longer prompts, a cache's first, and the other policies'
    questions attend all of their context. 0: every prompt attends all of it.
    """

    budget: float | int = 0.1
    sinks: int = 4
    window: int = 32
    selector: str = "last"
    selector_window: int = 8
    filter_layers: tuple[int, ...] | None = None
    full_after_filter: bool = False
    fetch_unit: str = "record"
    question_tokens: int = 64

    def __post_init__(self):
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0 or b != b:
            raise ValueError(f"budget={b!r}: must be a fraction in (0, 1] or a token count >= 1")
        if isinstance(b, float) and b > 1 and not b.is_integer():
            raise ValueError(f"budget={b!r}: a token count must be a whole number")
        if b > MAX_BUDGET_TOKENS:
            raise ValueError(f"budget={b!r}: a token count must be at most {MAX_BUDGET_TOKENS}")
        _check_range("sinks", self.sinks, 0, 1 << 20)
        _check_range("window", self.window, 1, 1 << 20)
        _check_range("selector_window", self.selector_window, 1, 4096)
        _check_range("question_tokens", self.question_tokens, 0, MAX_QUESTION_TOKENS)
        if self.selector not in SELECTORS:
            raise ValueError(f"selector={self.selector!r}: must be one of {', '.join(SELECTORS)}")
        if not isinstance(self.full_after_filter, bool):
            raise ValueError(f"full_after_filter={self.full_after_filter!r}: expected True or False")
        if self.filter_layers is not None and not isinstance(self.filter_layers, (tuple, list)):
            raise ValueError(f"filter_layers={self.filter_layers!r}: expected a sequence of "
                             "layer indices, e.g. (2, 8, 16)")
        if self.fetch_unit not in FETCH_UNITS:
            raise ValueError(f"fetch_unit={self.fetch_unit!r}: must be one of {', '.join(FETCH_UNITS)}")
        if self.filter_layers is not None:
            layers = tuple(self.filter_layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"filter_layers={self.filter_layers!r}: expected non-negative layer indices")
            if list(layers) != sorted(set(layers)):
                raise ValueError(f"filter_layers={self.filter_layers!r}: must be strictly increasing")
            object.__setattr__(self, "filter_layers", layers)

    @property
    def fraction(self) -> bool:
        """Whether ``budget`` is a fraction of the context (else a token count)."""
        return isinstance(self.budget, float) and self.budget <= 1

    def tokens(self, context: int) -> int:
        """The token budget for a context of ``context`` tokens."""
        if self.fraction:
            return max(1, int(round(self.budget * context)))
        return int(self.budget)
