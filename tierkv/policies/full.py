"""``full``: every token attended; the KV is still tiered (the brute-offload baseline)."""
from .base import Policy, register


@register
class Full(Policy):
    """Attend to every token; lossless; reads all of every layer's KV every step."""

    name = "full"
