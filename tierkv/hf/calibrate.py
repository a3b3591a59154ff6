"""Calibration of a model profile: OmniKV filter layers and RazorAttention retrieval heads.

``layer_similarity`` measures how well one layer's most-attended tokens serve another layer
(OmniKV, Fig. 1a: adjacent layers attend alike), ``propose_filter_layers`` picks the filter
layers from it, and ``retrieval_heads`` finds the echo and induction heads of RazorAttention on a
repeated random-token prompt. ``calibrate`` runs all three and returns the profile that
``profile.save_profile`` writes and the ``omnikv`` / ``razor`` policies read.
"""
from __future__ import annotations

import math
import random
from contextlib import contextmanager

import torch

from ..config import SelectConfig
from ..shapes import KVShape
from ..textgen import chat_prompt, make_document, passkey_fact
from .profile import model_id

_QUERIES = 8  # the last prompt tokens whose attention stands in for a decode step's
# The filter layers ``calibrate`` proposes: this many, the first at this layer.
N_FILTERS = 3
FIRST_FILTER = 2


@contextmanager
def _recorded_attention(model, first_query: int):
    """Record each layer's attention probabilities of the queries from ``first_query`` on.

    Yields a list that fills, during a forward pass, with one tensor per layer of shape
    (q_heads, queries, keys). The model runs eager attention (which returns its probabilities)
    with a forward hook per attention module; both are undone on exit.
    """
    modules = [layer.self_attn for layer in _decoder_layers(model)]
    records: list[torch.Tensor] = []

    def keep(module, args, output):
        records.append(output[1][0, :, first_query:].detach().float().cpu())

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)


def _decoder_layers(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"{type(model).__name__}: expected model.model.layers[i].self_attn "
                         "(a Llama-style decoder)")
    return layers


def _attention(model, input_ids: torch.Tensor, first_query: int) -> torch.Tensor:
    """Attention of queries ``first_query:`` at every layer, shape (layers, q_heads, queries, keys)."""
    with _recorded_attention(model, first_query) as records, torch.no_grad():
        device = next(model.parameters()).device
        model(input_ids=input_ids.unsqueeze(0).to(device), use_cache=False)
    return torch.stack(records)


def _check_fraction(name: str, value: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or not (0 < value <= 1 if low_open else 0 <= value <= 1):
        allowed = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name}={value!r}: must be a fraction in {allowed}")


def top_set_similarity(token_mass: torch.Tensor, top_frac: float) -> torch.Tensor:
    """Similarity of layers' attention by their top tokens.

    Parameters
    ----------
    token_mass : Tensor, shape (layers, tokens)
        Attention mass per context token at each layer.
    top_frac : fraction of the tokens in each layer's top set.

    Returns
    -------
    Tensor, shape (layers, layers): ``[i, j]`` is the share of layer j's top-set mass that layer
    i's top set captures, ``mass_j[top_i].sum() / mass_j[top_j].sum()``; 1 on the diagonal, in
    [0, 1] (a top set holds the most mass of any set its size).
    """
    _check_fraction("top_frac", top_frac, low_open=True)
    if token_mass.dim() != 2 or token_mass.shape[1] == 0:
        raise ValueError(f"token_mass shape {tuple(token_mass.shape)}: expected (layers, tokens > 0)")
    k = max(1, math.ceil(top_frac * token_mass.shape[1]))
    top = torch.zeros_like(token_mass, dtype=torch.bool)
    top.scatter_(1, token_mass.topk(k, dim=1).indices, True)
    captured = top.float() @ token_mass.T  # [i, j] = mass of layer j on layer i's top set
    return (captured / captured.diagonal().clamp_min(1e-12)).clamp(0, 1)


def layer_similarity(model, tokenizer, n_tokens: int = 1024, seed: int = 0,
                     top_frac: float = 0.1) -> torch.Tensor:
    """Inter-layer attention similarity on a generated document with a planted pass key.

    The prompt is the document and its question in the chat template. At each layer the
    attention of the last few prompt tokens, summed over query heads and those tokens, is taken
    over the context a sparse layer selects from (after the sinks, before the recent window,
    both as in ``SelectConfig``'s defaults), and compared by ``top_set_similarity``.

    Parameters
    ----------
    model, tokenizer : a Llama-style causal LM and its tokenizer.
    n_tokens : length of the document, in tokens (>= 16).
    seed : seed of the document.
    top_frac : fraction of the context in each layer's top set.

    Returns
    -------
    Tensor, shape (layers, layers), see ``top_set_similarity``.
    """
    _check_fraction("top_frac", top_frac, low_open=True)
    fact = passkey_fact(random.Random(seed))
    document = make_document(tokenizer, n_tokens, seed, [fact])
    prompt = chat_prompt(tokenizer, document, fact.question, fact.answer_prefix, fact.hint)
    ids = torch.tensor(tokenizer(prompt)["input_ids"])
    select = SelectConfig()
    if len(ids) <= select.sinks + select.window + _QUERIES:
        raise ValueError(f"n_tokens={n_tokens}: prompt too short to leave a context to select from")
    probs = _attention(model, ids, len(ids) - _QUERIES)
    token_mass = probs.sum(dim=(1, 2))[:, select.sinks: len(ids) - select.window]
    return top_set_similarity(token_mass, top_frac)


def propose_filter_layers(similarity: torch.Tensor, n_filters: int = N_FILTERS,
                          first: int = FIRST_FILTER) -> list[int]:
    """Filter layers that best serve the layers after them.

    Every layer from ``first`` on follows the closest filter layer at or before it; the rule is
    to maximise the sum, over the layers that are not filters, of
    ``similarity[filter_of(layer), layer]`` (exactly, by dynamic programming over the split of
    layers ``first..`` into ``n_filters`` runs, each headed by its filter). The first filter is
    therefore ``first``: a later one would leave layers before it with no filter to follow,
    which can only lower the sum. The last layer is never a filter: it has no layer after it to
    serve. Ties go to the earlier layers.

    Parameters
    ----------
    similarity : Tensor, shape (layers, layers), ``[i, j]`` how well layer i's choice serves j.
    n_filters : number of filter layers, in [1, layers - 1 - first].
    first : the first layer that may be a filter (earlier layers attend diffusely, densely).

    Returns
    -------
    list[int], strictly increasing filter layer indices, the first being ``first``.
    """
    if similarity.dim() != 2 or similarity.shape[0] != similarity.shape[1]:
        raise ValueError(f"similarity shape {tuple(similarity.shape)}: expected (layers, layers)")
    layers = similarity.shape[0]
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"first={first!r}: must be a layer index >= 0")
    if isinstance(n_filters, bool) or not isinstance(n_filters, int) or n_filters < 1:
        raise ValueError(f"n_filters={n_filters!r}: must be a number of filter layers >= 1")
    if n_filters > layers - 1 - first:
        raise ValueError(f"n_filters={n_filters}: {layers} layers are too few for {n_filters} filter "
                         f"layers from layer {first} on, each with a layer after it (at most "
                         f"{max(0, layers - 1 - first)} fit)")
    run = _run_scores(similarity.double(), first)
    # best[k][b]: best score of layers first..b-1 split into k runs; cut[k][b]: where run k starts
    best = [[-math.inf] * (layers + 1) for _ in range(n_filters + 1)]
    cut = [[0] * (layers + 1) for _ in range(n_filters + 1)]
    best[0][first] = 0.0
    for k in range(1, n_filters + 1):
        for end in range(first + k, layers + 1):
            for start in range(first + k - 1, min(end, layers - 1)):
                score = best[k - 1][start] + run[start][end]
                if score > best[k][end]:
                    best[k][end], cut[k][end] = score, start
    return _filters_from_cuts(cut, n_filters, layers)


def _run_scores(similarity: torch.Tensor, first: int) -> list[list[float]]:
    """``run[a][b]``: score of the run of layers a..b-1 headed by filter a."""
    layers = similarity.shape[0]
    run = [[0.0] * (layers + 1) for _ in range(layers + 1)]
    for a in range(first, layers):
        for b in range(a + 2, layers + 1):
            run[a][b] = run[a][b - 1] + float(similarity[a, b - 1])
    return run


def _filters_from_cuts(cut: list[list[int]], n_filters: int, layers: int) -> list[int]:
    filters, end = [], layers
    for k in range(n_filters, 0, -1):
        end = cut[k][end]
        filters.append(end)
    return filters[::-1]


def copy_scores(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Echo and induction scores of every head on a prompt ``[bos] + r + r`` with ``len(r) == n``.

    Parameters
    ----------
    probs : Tensor, shape (layers, q_heads, n, 2 * n + 1)
        Attention of the second copy's n tokens over the whole prompt.
    n : length of one copy, >= 2.

    Returns
    -------
    (echo, induction), each a Tensor of shape (layers, q_heads): the mean attention from a
    token of the second copy to the same token in the first copy (echo), and to the token after
    it (induction; the last token of the copy has none and is left out).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n={n!r}: must be an int >= 2")
    if probs.dim() != 4 or tuple(probs.shape[2:]) != (n, 2 * n + 1):
        raise ValueError(f"probs shape {tuple(probs.shape)}: expected (layers, q_heads, {n}, {2 * n + 1})")
    rows = torch.arange(n)
    echo = probs[:, :, rows, rows + 1].mean(dim=-1)
    induction = probs[:, :, rows[:-1], rows[:-1] + 2].mean(dim=-1)
    return echo, induction


def select_retrieval_heads(echo: torch.Tensor, induction: torch.Tensor, kv_heads: int,
                           induction_frac: float = 0.14, echo_frac: float = 0.01) -> dict[int, list[int]]:
    """RazorAttention's retrieval heads, as whole GQA groups.

    The query heads in the top ``induction_frac`` of all heads by induction score, and those in
    the top ``echo_frac`` by echo score (each count rounded up), are retrieval heads; a KV head
    is kept whole when any of its query heads is one (``kv = q // (q_heads // kv_heads)``).

    Parameters
    ----------
    echo, induction : Tensor, shape (layers, q_heads), see ``copy_scores``.
    kv_heads : number of KV heads; must divide q_heads.
    induction_frac, echo_frac : fractions in [0, 1] of all query heads.

    Returns
    -------
    dict[int, list[int]]: layer -> sorted KV head indices, only layers that have some.
    """
    _check_fraction("induction_frac", induction_frac)
    _check_fraction("echo_frac", echo_frac)
    if echo.dim() != 2 or echo.shape != induction.shape:
        raise ValueError(f"echo {tuple(echo.shape)} and induction {tuple(induction.shape)}: "
                         "expected equal shapes (layers, q_heads)")
    q_heads = echo.shape[1]
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads!r}: must be a positive divisor of q_heads={q_heads}")
    chosen = _top_heads(induction, induction_frac) | _top_heads(echo, echo_frac)
    group = q_heads // kv_heads
    heads: dict[int, list[int]] = {}
    for layer, q in chosen.nonzero().tolist():
        heads.setdefault(layer, set()).add(q // group)
    return {layer: sorted(kv) for layer, kv in sorted(heads.items())}


def _top_heads(scores: torch.Tensor, frac: float) -> torch.Tensor:
    """Mask of the top ``ceil(frac * heads)`` heads over all layers (ties: lower index first)."""
    flat = scores.flatten()
    count = math.ceil(frac * flat.numel())
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[torch.sort(flat, descending=True, stable=True).indices[:count]] = True
    return mask.view_as(scores)


def retrieval_heads(model, n_tokens: int = 256, seed: int = 0, induction_frac: float = 0.14,
                    echo_frac: float = 0.01) -> dict[int, list[int]]:
    """RazorAttention retrieval heads of ``model``, found on a repeated random-token prompt.

    The prompt is BOS (token 0 when the model has none) and ``n_tokens`` distinct random tokens (seeded)
    repeated twice; see ``copy_scores`` and ``select_retrieval_heads``.

    Parameters
    ----------
    model : a Llama-style causal LM.
    n_tokens : length of one copy, in [2, vocab_size // 2].
    seed : seed of the random tokens.
    induction_frac, echo_frac : see ``select_retrieval_heads``.

    Returns
    -------
    dict[int, list[int]]: layer -> sorted KV head indices, only layers that have some.
    """
    config = model.config
    low = 3  # above the special tokens of common tokenizers (unk/bos/eos/pad)
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 2 <= n_tokens <= (config.vocab_size - low) // 2:
        raise ValueError(f"n_tokens={n_tokens!r}: must be in [2, {(config.vocab_size - low) // 2}]")
    gen = torch.Generator().manual_seed(seed)
    copy = torch.randperm(config.vocab_size - low, generator=gen)[:n_tokens] + low
    sink = config.bos_token_id if config.bos_token_id is not None else 0  # a special token, below low
    ids = torch.cat([torch.tensor([sink]), copy, copy])
    probs = _attention(model, ids, n_tokens + 1)
    echo, induction = copy_scores(probs, n_tokens)
    return select_retrieval_heads(echo, induction, config.num_key_value_heads, induction_frac, echo_frac)


def calibrate(model, tokenizer) -> dict:
    """The profile of ``model``: filter layers and retrieval heads, with default settings.

    Returns
    -------
    dict: ``model`` (the model id), ``filter_layers``, ``retrieval_heads`` (``{"<layer>":
    [kv heads]}``), ``similarity_mean_next`` (mean similarity of each layer to the next one) and
    ``created_by``; ready for ``profile.save_profile(profile, profile["model"])``.
    """
    layers = KVShape.from_config(model.config).layers
    if layers < FIRST_FILTER + N_FILTERS + 1:
        raise ValueError(f"model {model_id(model)!r} has {layers} layers, too few to calibrate "
                         f"{N_FILTERS} filter layers: they start at layer {FIRST_FILTER} and the "
                         f"last layer cannot be one (at least {FIRST_FILTER + N_FILTERS + 1} layers)")
    similarity = layer_similarity(model, tokenizer)
    heads = retrieval_heads(model)
    return {
        "model": model_id(model),
        "filter_layers": propose_filter_layers(similarity),
        "retrieval_heads": {str(layer): kv for layer, kv in heads.items()},
        "similarity_mean_next": round(float(similarity.diagonal(1).mean()), 4),
        "created_by": "tierkv calibrate",
    }
