"""``leoam``: per-layer selection on the adaptive chunk tree with LKA min/max summaries (LeoAM)."""
from .base import register
from .quest import Quest


@register
class LeoAM(Quest):
    """Like ``quest``, on adaptive chunks: cold runs merge, hot chunks split (IAKM)."""

    name = "leoam"
    adaptive = True

    @property
    def chunk_tokens(self) -> int:
        return self.chunks.base
