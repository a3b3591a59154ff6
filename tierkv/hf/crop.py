"""Taking back the newest tokens: transformers' ``Cache.crop``, which assisted and prompt-lookup
decoding call after each pass that verifies drafted tokens, to drop those the model rejected.

A verifying pass feeds the drafted tokens (a prompt of a few tokens: through ``omnikv``'s and
``tierkv``'s selection, as a question) and they enter every layer's recent window; the window
keeps at least ``SelectConfig.window`` tokens after any pass (older ones are sealed in whole
records), so the rejected ones are still there, and taking them back cuts only the windows, the
token ids and what the policy holds for their positions (``Policy.crop``). Records are never cut:
a crop that would reach a sealed token is refused, with nothing changed.
"""
from __future__ import annotations

import operator

from .hooks import check_whole


def crop(cache, tokens_to_remove: int) -> None:
    """Take the newest ``-tokens_to_remove`` tokens back out of ``cache`` (transformers' sign:
    ``crop(-3)`` removes three; ``crop(0)`` nothing). ValueError, with nothing changed, for a
    positive count or more tokens than every layer's recent window holds."""
    try:  # an int, or what indexes like one (a 0-d integer tensor)
        if isinstance(tokens_to_remove, bool):
            raise TypeError
        tokens_to_remove = operator.index(tokens_to_remove)
    except TypeError:
        raise TypeError(f"crop(tokens_to_remove={tokens_to_remove!r}): expected an int "
                        "<= 0") from None
    if tokens_to_remove > 0:
        raise ValueError(f"crop({tokens_to_remove}): a TieredCache takes a negative count of "
                         "tokens to remove (transformers' crop(-n)), not a length to keep")
    check_whole(cache, "be cropped")
    count = -tokens_to_remove
    if count == 0:
        return
    held = cache.shortest_window()
    n = cache.get_seq_length()
    if count > held:
        raise ValueError(
            f"crop({tokens_to_remove}): the cache holds {n} tokens, of which the newest {held} "
            "are in every layer's recent window; a crop takes back only those (older ones are "
            f"sealed in records). Keep at most {held} drafted tokens a pass (a larger "
            "SelectConfig.window keeps more)")
    for layer in range(cache.shape.layers):
        cache._window.drop_last(layer, count)
    cache.token_ids = cache.token_ids[:, :min(cache.token_ids.shape[1], n - count)]
    cache.policy.crop(cache, n - count)
    cache.prompt_mass.clear()  # the cut pass's last queries' attention: not the prompt's now
    cache.prompt_query.clear()
