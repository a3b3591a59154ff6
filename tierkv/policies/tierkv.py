"""``tierkv`` (default): OmniKV filter layers choosing LeoAM adaptive chunks.

When a filter layer's own KV does not fit in the device tier's free budget, its chunks are first
preselected by their LKA upper bounds, and exact attention runs over the candidates only. The
layers before the first filter layer, which ``omnikv`` reads whole, preselect by the same rule:
their KV grows with the context like any layer's, and read whole every step it would dominate
the transfers of a long context. Measured on SmolLM2 (layers 0 and 1 before filter layer 2):

* ``bench.decode``'s 8K case (device 5 % of the KV, 64 steps, in one process): 3.37 MB read from
  disk per token against 4.93, and each of layers 0 and 1 brings 1,504 tokens to the device
  instead of 7,552; top-1 agreement 0.922 either way, speed within the run's noise (127 / 132
  against 133 / 128 ms per token).
* ``bench.quality``'s contexts, ``tierkv`` only: top-1 agreement 0.750 / 0.859 / 0.906 at
  5 / 10 / 25 % against 0.755 / 0.859 / 0.906 (one token of 192 differs), pass-key unchanged.
  Sealing those layers in 32-token records (the filter layers') instead of ``DENSE_RECORD_TOKENS``
  gave the same three figures, so they keep the larger records (fewer reads).

A filter layer's candidates are ``PRESELECT_FACTOR`` x the token budget, and at least
``PRESELECT_FLOOR`` of the context: the bounds rank loosely, and what the filter layer does not
score, no following layer attends. Measured with ``bench.quality``'s contexts (2K/4K/8K, 64
teacher-forced tokens each): at a 5 % budget, candidates of 4x (20 % of the context) gave top-1
agreement 0.719, 8x 0.745 and the floor 0.755 (``omnikv``, scoring all of it: 0.771); at 10 %,
all three gave 0.859.

The layers before the first filter layer attend their own candidates only, so they take the
token budget, as a selecting layer does. Measured with ``bench.decode``'s 8K case (device 5 % /
host 20 % of the KV, 10 % budget, 64 teacher-forced steps, 2026-11-27), the floor's 40 % of the
context against 10 % and 5 % for layers 0 and 1: top-1 agreement 0.969 / 0.969 on the bench's
document (seed 0), 0.812 / 0.812 / 0.812, 0.844 / 0.844 / 0.844 and 0.906 / 0.906 / 0.891 on
seeds 1-3; disk reads 3.9 against 3.1 MB a token; in one process decoding alternate blocks of 8
steps, 117.0 against 113.4 ms a token and 123.9 against 114.8 (two runs; ``full_memory`` 131.7,
136.6). Less would not be faster: their fetches are six 128-token records each, ~0.3 ms a
layer. On one cache decoding alternate blocks of 8 steps (2026-11-28), the budget took 96.4 ms a
token, the sinks alone 96.7 and half the budget 99.1 (``full_memory`` 116.5).

The candidates also stay within what the device tier holds beside every layer's recent window
(``TieredCache.fetch_room``), down to ``PRESELECT_MIN_FACTOR`` x the budget, and below that only
where the tier does not hold it (``fit_to_device``: cut, with a warning). A filter layer's
candidates and the chunks it chooses for the layers after it are never on the device together
(``TieredCache.set_selection`` fetches the choice once the candidates are let go), so a device tier
of 5 % of the KV holds the whole 40 % at 8K. Measured with ``bench.decode --cases tierkv`` (8,128
tokens, device 5 % of the KV, 10 % budget, 64 steps, one process each): candidates held to what fit
beside that fetch, as before (20 % of the context): top-1 agreement 0.828, 4.21 MB read from disk
per token, 1.13x full memory in the paired run; the whole 40 %: 0.906, 7.36 MB, 0.90x. Before the
fetch waited, the case needed a device tier of 5.6 % (candidates 33 %: 0.922, 5.62 MB, 1.00x).

The candidates depend on the query, so their fetch waited for it: at 8K on the CPU, 2 ms a step
for each of layers 0 and 1 and 4 ms for each filter layer, 16 of the step's 20 ms of stall.
With ``TieredCache.fetch_ahead`` they are ranked by the layer's query of the last step instead
(``ahead``) and fetched while the layers before compute (layer 0's at the end of the step
before). Measured on the 2-core CPU, ``bench.decode``'s 8K case (device 5 % of the KV, 64
steps, caches in one process decoding alternate blocks of 8 steps; ``bench.decode --cases
tierkv --fetch-ahead both``): the stall fell from 0.29-0.30 of the step to 0.12-0.15 and top-1
agreement went from 0.906 to 0.922, but a step took longer, 172.4 ms against 168.9 (that
command), 144.5 against 139.5 and 152.9 against 144.4 (two runs of the same comparison by a
script): the copies ran on the cores the step computes on, instead of while it waited. With
one compute thread (a core left to the copies), 131.1 against 134.2, both slower than 2
threads without it (148.9 against 140.2 in one run). So it is on by default only on a GPU,
whose copies run beside the compute (a copy engine, and a packing thread on a many-core host);
not yet measured there. Measured again once the cache's threads computed on one thread each
(``tierkv.workers``; same command, 2026-11-29): 116.9 against 118.8 ms a token, stall 0.088
against 0.083, top-1 0.969 both (``full_memory`` 160.7): still no gain on this CPU.

The candidates change little from step to step: the leaves a layer fetched at its last step
rank ``PRESELECT_STICKINESS`` x the leaves higher (a leaf ranks by its best place over the kv
heads), so a leaf the query ranks slightly lower than a new one stays. Ranked by the query
alone they drifted at their margin, and of the 40-117 records a step read from disk at 8K most
had been fetched a few steps before (``storage/ranking.py``). Measured with ``bench.decode
--cases tierkv`` (8,128 tokens, device 5 % / host 20 % of the KV, 10 % budget, 64 steps, on
2026-11-27; the speed is ``full_memory``'s ms/token over ``tierkv``'s when the two decode
alternate blocks of 8 steps in one process):

==========  ===============  ==========  =====  ==========================
stickiness  disk MB / token  stall       top-1  speed vs full memory
==========  ===============  ==========  =====  ==========================
0 (before)  7.36             0.28        0.906  1.00, 0.98 (two runs)
0.1         6.09             0.27        0.906  0.96
0.3         4.38             0.22        0.922  1.06
0.6         3.91             0.21, 0.20  0.969  1.07, 1.13 (two runs)
==========  ===============  ==========  =====  ==========================

Top-1 agreement is over 64 tokens (one token is 0.016). Stickier than 0.6 gained nothing: in one
process decoding alternate blocks of 8 steps, 0.6 / 1.0 / 2.0 read 3.91 / 3.84 / 3.84 MB a token
with top-1 0.969 / 0.953 / 0.953, at 148.8 / 148.6 / 144.5 ms a token (full memory: 156.2).

With the candidates sticky, the 40 % they ask for is what keeps that agreement: in one process
decoding alternate blocks of 8 steps (same case, 2026-11-27), ``PRESELECT_FACTOR`` 4 / 3 / 2 (no
floor) gave top-1 0.969 / 0.922 / 0.906, 3.79 / 2.31 / 1.42 MB read from disk a token and 174 /
160 / 155 ms a token (full memory: 208). The chunks a filter layer chooses for the layers after
it were made sticky the same way too (a chunk chosen at the last step counted 1.5x denser): disk
reads fell from 3.91 to 3.28 MB a token (2.96 at 2x), but a step was no faster (149.6 against
142.6 ms in a paired run; top-1 0.969 either way) and ``bench.quality``'s top-1 at 5 / 10 / 25 %
went from 0.745 / 0.859 / 0.906 to 0.755 / 0.849 / 0.901: not kept.
"""
import torch

from .base import layers_of, per_layer, register
from .omnikv import OmniKV, held_together

PRESELECT_FACTOR = 4
PRESELECT_FLOOR = 0.4
PRESELECT_MIN_FACTOR = 2
PRESELECT_STICKINESS = 0.6


@register
class TierKV(OmniKV):
    """OmniKV selection over adaptive chunks; LKA preselection for the filter layers and those
    before the first on big contexts."""

    name = "tierkv"
    adaptive = True

    def __init__(self, layers, select, chunks, profile):
        super().__init__(layers, select, chunks, profile)
        self._queries: dict[int, torch.Tensor] = {}  # layer -> its last decode query, CPU
        self._ahead: dict[int, tuple[int, torch.Tensor]] = {}  # layer -> (sealed, candidates)
        self._fetched: dict[int, torch.Tensor] = {}  # layer -> the candidates it fetched last
        self._marked_own: tuple[dict, dict, dict] = ({}, {}, {})  # the three as a pass began

    def mark(self):  # a step replaces each layer's entries, never writes them
        super().mark()
        self._marked_own = dict(self._queries), dict(self._ahead), dict(self._fetched)

    def roll_back(self, cache, tokens):
        super().roll_back(cache, tokens)
        self._queries, self._ahead, self._fetched = (dict(kept) for kept in self._marked_own)

    def state(self):  # the last step's queries (fetch_ahead ranks by them) and candidates
        return {**super().state(), **per_layer("query", self._queries),
                **per_layer("fetched", self._fetched)}

    def load_state(self, arrays):
        super().load_state(arrays)
        self._queries, self._fetched = layers_of("query", arrays), layers_of("fetched", arrays)

    def preselects(self, cache, layer):
        """Whether ``layer`` preselects: a filter layer, or one before the first (which
        ``omnikv`` reads whole), whose group's KV outgrows a quarter of the device tier, or what
        the tier holds beside the recent windows."""
        if layer not in self.filters and layer >= self.filters[0]:
            return False
        budget = cache.store.device.budget
        if budget is None:
            return False
        group = cache.group_of[layer]  # (or no longer fits beside the windows, read whole)
        return cache.group_bytes(layer) > budget // 4 or \
            cache.indexes[group].sealed > cache.fetch_room(group)

    def ahead(self, cache, layer):
        """With ``cache.fetch_ahead``, a preselecting layer's candidates are known before its
        query: those its query of the last step ranks first (re-ranked when more context was
        sealed since), so they are fetched while the layers before it compute."""
        if not self.preselects(cache, layer):
            return super().ahead(cache, layer)
        query = self._queries.get(layer)
        if query is None or not cache.fetch_ahead:
            return False, None
        sealed = cache.index_of(layer).sealed
        held = self._ahead.get(layer)
        if held is None or held[0] != sealed:
            held = sealed, self._candidates(cache, layer, query)
            self._ahead[layer] = held
        return True, held[1]

    def preselect(self, cache, layer, q):
        if not self.preselects(cache, layer):
            return None
        self._queries[layer] = q[:, -1].cpu()  # the newest token's: the next step's guess
        held = self._ahead.pop(layer, None)
        if q.shape[1] > 1:  # a pass verifying drafted tokens
            chosen = self._candidates_each(cache, layer, q)
        elif held is not None and held[0] == cache.index_of(layer).sealed:
            chosen = held[1]  # announced by ``ahead``: being fetched
        else:
            chosen = self._candidates(cache, layer, q[:, 0].cpu())
        self._fetched[layer] = chosen
        return chosen

    def _candidates_each(self, cache, layer, q):
        """A verifying pass's candidates: those each of its tokens ranks first alone, as its
        decode step would, all together where the device tier holds their records; else those
        all of their query heads rank first together, within one step's number."""
        ranked = cache.index_of(layer).bound_scores_each(q.cpu())  # (t, leaves)
        leaves = held_together(cache, cache.group_of[layer], [
            self._candidates(cache, layer, None, fetching=False, scores=row) for row in ranked])
        return self._candidates(cache, layer, q.reshape(-1, q.shape[-1]).cpu()) \
            if leaves is None else leaves

    def question_preselect(self, cache, layer, q):
        """A preselecting layer's candidates for a question: ranked by the bounds of all of its
        queries' heads (a kv head's bound is the largest over them), by the rule of a decode
        step's with the question's budget (``question_budget``). The last step's queries and
        candidates stay those of the last step."""
        if not self.preselects(cache, layer):
            return None
        return self._candidates(cache, layer, q.reshape(-1, q.shape[-1]).cpu(),
                                budget=self.question_budget(cache))

    def prompt_candidates(self, cache, layer, query):
        """A preselecting layer's candidates for ``query``, a prompt's last (None for the
        others): the first decode step's are mostly the same leaves."""
        return self._candidates(cache, layer, query, fetching=False) \
            if self.preselects(cache, layer) else None

    def _candidates(self, cache, layer, query, fetching: bool = True, budget: int | None = None,
                    scores: torch.Tensor | None = None):
        """The leaves ``query`` (q_heads, head_dim) ranks first by their LKA bounds, those the
        layer fetched last ``PRESELECT_STICKINESS`` x the leaves higher, as many as the rule of
        this module's docstring allows (``fetching``: for a decode step's fetch, which a cut to
        fit the device tier counts). With ``budget`` (a question's), that token budget instead of
        a decode step's, and no cut to the device tier's room (a question holds one layer's
        slice at a time, and ``check_prompt_room`` saw each layer's whole context fit)."""
        index, group = cache.index_of(layer), cache.group_of[layer]
        question = budget is not None
        budget = self.budget(cache) if budget is None else budget
        if layer < self.filters[0]:  # it attends its own candidates only: the budget's worth
            candidates = budget
        else:
            wanted = max(PRESELECT_FACTOR * budget, int(PRESELECT_FLOOR * index.sealed))
            room = None if question else cache.fetch_room(group)
            if room is not None:
                wanted = min(wanted, room)
            candidates = max(PRESELECT_MIN_FACTOR * budget, wanted)
        if not question:
            candidates = cache.fit_to_device(group, candidates, count=fetching)
        scores = index.bound_scores(query) if scores is None else scores  # (``query``'s ranking)
        last = self._fetched.get(layer)
        if last is not None:  # leaves only ever append here: the indices still name them
            scores[last[last < scores.numel()]] += PRESELECT_STICKINESS * scores.numel()
        return index.top_chunks(scores, candidates, self.select.sinks)
