"""End-to-end decode speed and quality of every policy on SmolLM2 with the KV on disk.

One seeded generated document is prefilled once per case, then 64 tokens are decoded greedily,
all cases in one process. The document is as long as the model's context leaves room for: 8,128
tokens, so that the 64 decoded ones end at SmolLM2's 8,192 (--quick: 2,048 tokens, 16 steps):

* ``full_memory``: transformers' ``DynamicCache`` (the reference for speed and quality);
* ``brute_offload``: ``TieredCache`` policy ``full`` with a 1 MB host tier, so all KV is on
  disk and every layer's KV is read back every step;
* ``offloaded`` (on a GPU only): transformers' own ``DynamicCache(offloading=True)``, every
  layer's KV in CPU RAM and brought back to the GPU each step (the next layer's on a side
  stream): what a transformers user tries first when the KV outgrows the GPU;
* ``quest``, ``leoam``, ``omnikv``, ``h2o``, ``razor``, ``tierkv``: ``TieredCache`` with the
  device tier <= 5 % of the KV, the host tier 20 %, the rest on disk, ``SelectConfig(budget=0.1)``.

``full_memory`` runs first and again last; its ``ms_per_token`` is the mean of the two runs, both
are kept (``ms_per_token_runs``) and ``full_memory_drift`` (last / first) says how much the
machine's speed moved during the run (on this VM it has moved by up to 1.76x in 20 minutes).
``speedup_vs_full_memory`` therefore comes from a paired run: ``full_memory`` and ``tierkv``
(at the device budget its own case ended with) decode the same tokens in alternating blocks of
``PAIR_BLOCK`` steps (every other round in reverse order), both caches live, so a change of
machine speed weighs on both alike; the ratio of the separate cases is kept as
``speedup_vs_full_memory_unpaired``.

Each case is fed full_memory's greedy tokens (teacher forcing, so positions align);
``top1_agreement`` is the share of steps whose argmax equals full_memory's, ``kl`` the mean
KL divergence of full_memory's next-token distribution from the case's (nats), and
``top1_misses`` the steps whose argmax differs, each with full_memory's own margin there (its
top-1 log-probability minus its second's): a miss at a margin of a few tenths is a near tie,
and over 64 tokens KL tells budgets apart that top-1 does not (``bench.common.divergence``).
The page cache of the disk tier's segment files is dropped after prefill. When a case raises
``TierFullError``, or its device tier would cut a step's selection below the token budget
(``tierkv.DeviceBudgetWarning``, an error here: the case would measure a smaller budget), its
device budget is raised by the shortfall named (at least 10 %) and the value used is recorded.

On a machine with CUDA the model, ``full_memory``'s cache and the device tier are on the GPU
(``TIERKV_BENCH_DEVICE=cpu`` keeps them on the CPU), every timed step ends with a device
synchronisation, and the result goes to ``decode.gpu.json``, beside the CPU figures.

The cases run ``tierkv`` (and the paired run) first and the three that read all KV every step
last; after each case the figures so far go to ``decode.partial.json`` (``"partial": true``, no
drift), which the complete run removes: a run cut short, as on a GPU lent for minutes, still
leaves its headline.

    python -m bench.decode [--quick]   ->  bench/results/decode.json
"""
from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache

from bench.common import (bench_device, divergence, document_ids, drop_page_cache, log_probs,
                          result_path, sync, write_result)
from tierkv import (DeviceBudgetWarning, SelectConfig, TierConfig, TieredCache, TierFullError,
                    load_model)
from tierkv.config import ChunkConfig
from tierkv.hf.model import cache_kwargs
from tierkv.shapes import KVShape

SPARSE = ("quest", "leoam", "omnikv", "h2o", "razor", "tierkv")
DEVICE_SHARE, HOST_SHARE, SELECT = 0.05, 0.20, 0.1
CHUNKS = ChunkConfig()  # the default tree; ``--chunk-min`` changes it for a profiling run
FETCH_UNIT = "record"  # SelectConfig.fetch_unit; ``--fetch-unit`` changes it for a profiling run
PROFILE: Path | None = None  # ``--profile DIR``: torch.profiler over each case's decode steps
FETCH_AHEAD: bool | None = None  # TieredCache.fetch_ahead; None: the cache's default (on on a GPU)
BRUTE_HOST = 1_000_000
PAIR_BLOCK = 8  # decode steps per turn when full_memory and tierkv alternate
# The headline first (tierkv and the paired run right after full_memory), the cases that read all
# KV every step (~2.3-2.7 s a token at 8K on the 2-core CPU) last: twice a GPU lent for minutes
# ran out of time among them, the second time before tierkv was reached.
RUN_ORDER = ("tierkv", "offloaded", "quest", "leoam", "omnikv", "brute_offload", "h2o", "razor")


@torch.no_grad()
def run_decode(model, cache, ids: torch.Tensor, ref: torch.Tensor | None, steps: int, on_prefill=None,
               label: str | None = None):
    """Prefill ``ids``, then ``steps`` decode steps, each fed the reference's token ``i``
    (``ref``: its log-probabilities, shape (steps + 1, vocab)) or, without ``ref``, its own
    greedy token. Returns (log-probabilities after prefill and after each step, shape
    (steps + 1, vocab), in fp32 on the CPU; seconds per decode step (steps,)). With
    ``--profile``, the steps of a ``label``led run are profiled."""
    fed = None if ref is None else ref.argmax(-1).to(ids.device)
    logits = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits
    out = [log_probs(logits)]
    if on_prefill is not None:
        on_prefill()
    seconds = []
    with profiled(label):
        for i in range(steps):
            token = fed[i] if fed is not None else out[-1].argmax().to(ids.device)
            logits, took = timed_step(model, cache, token)
            out.append(log_probs(logits))
            seconds.append(took)
    return torch.stack(out), seconds


def timed_step(model, cache, token: torch.Tensor):
    """One decode step fed ``token`` (a 0-d id): (logits, seconds), the device synchronised on
    both sides."""
    sync(token.device)
    t0 = time.perf_counter()
    logits = model(token.view(1, 1), **cache_kwargs(model, cache), use_cache=True).logits
    sync(token.device)
    return logits, time.perf_counter() - t0


@contextlib.contextmanager
def profiled(label: str | None):
    """torch.profiler (CPU ops, and CUDA kernels and runtime calls on a GPU) over the block,
    when ``--profile DIR`` is given and the run has a ``label``: ``DIR/<label>.txt`` (operators
    by self CPU time, then by self device time) and ``DIR/<label>.trace.json`` (chrome://tracing).
    The CUDA runtime calls (``cudaStreamSynchronize``, ``cudaHostAlloc``, ``cudaMemcpyAsync``)
    show where a GPU step waits on the host."""
    if PROFILE is None or label is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    PROFILE.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if torch.cuda.is_available():
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=25))
    (PROFILE / f"{label}.txt").write_text("\n\n".join(tables))
    prof.export_chrome_trace(str(PROFILE / f"{label}.trace.json"))


@torch.no_grad()
def paired_speed(model, plain, ids, fed, steps: int, policy: str, device: int, host: int,
                 disk_dir: Path, block: int = PAIR_BLOCK) -> dict:
    """ms/token of ``full_memory`` and ``policy`` decoded in alternating blocks of ``block``
    steps, both caches live, so that a change in the machine's speed during the run weighs on
    both alike (``speedup_vs_full_memory`` comes from here). ``plain`` is a second instance of
    the model for ``full_memory``: a live TieredCache routes ``model``'s attention through it.
    ``block_speedups``: the ratio of each pair of blocks (``full_memory``'s ms/token over
    ``policy``'s, on the same tokens), which shows how far the machine's speed moved within the
    run."""
    full, tiered = DynamicCache(), new_cache(model, policy, device, host, disk_dir)
    try:
        out = alternate([("full_memory", plain, full), (policy, model, tiered)], ids, fed, steps,
                        block)
    finally:
        tiered.close()
    ms, blocks = out["ms_per_token"], out["block_ms"]
    return {"ms_per_token": ms, "speedup": ms["full_memory"] / ms[policy], "block_steps": block,
            "block_speedups": [f / t for f, t in zip(blocks["full_memory"], blocks[policy])]}


@torch.no_grad()
def paired_ahead(models, ids, fed, steps: int, device: int, host: int, root: Path,
                 block: int = PAIR_BLOCK) -> dict:
    """``tierkv`` with ``TieredCache.fetch_ahead`` on and off, and ``full_memory``, decoded in
    alternating blocks of ``block`` steps in one process (``--fetch-ahead both``): ms/token,
    stall share and top-1 agreement of each. ``models``: three instances of the model."""
    caches = []
    try:
        for ahead, model in zip((True, False), models):
            caches.append(new_cache(model, "tierkv", device, host, root / f"ahead-{ahead}"))
            caches[-1].fetch_ahead = ahead
        runs = [("fetch_ahead_on", models[0], caches[0]), ("fetch_ahead_off", models[1], caches[1]),
                ("full_memory", models[2], DynamicCache())]
        out = alternate(runs, ids, fed, steps, block)
        out["stall_frac"] = {name: cache.stats()["pipeline_total"]["stall_frac"]
                             for (name, _, _), cache in zip(runs, caches)}
    finally:
        for cache in caches:
            cache.close()
    return {**out, "block_steps": block}


def alternate(runs, ids, fed, steps: int, block: int) -> dict:
    """Prefill ``ids`` into each of ``runs`` (name, model, cache) (a TieredCache's disk pages
    dropped after), then feed each the reference's token ``fed[i]`` for ``steps`` steps,
    ``block`` steps per turn: ms/token, top-1 agreement with ``fed[i + 1]`` and ms/token of each
    block, per name.

    Every other round takes the runs in reverse order (A B, B A, A B, ...), so that each run's
    blocks follow another run's as often as its own: decoding one cache with variants switched
    block by block, the block right after ``full_memory``'s was 2-5 ms a token slower in median
    than the blocks after it (2026-11-27), and always putting one run there would charge that
    to it alone."""
    for _, net, cache in runs:
        net(ids, **cache_kwargs(net, cache), use_cache=True, logits_to_keep=1)
        if isinstance(cache, TieredCache):
            drop_disk(cache)
    seconds = {name: [] for name, _, _ in runs}
    agree = {name: 0 for name, _, _ in runs}
    for turn, start in enumerate(range(0, steps, block)):
        for name, net, cache in (runs if turn % 2 == 0 else runs[::-1]):
            for i in range(start, min(start + block, steps)):
                logits, took = timed_step(net, cache, fed[i])
                seconds[name].append(took)
                agree[name] += int(logits[0, -1].argmax() == fed[i + 1])
    return {"ms_per_token": {name: 1e3 * sum(s) / len(s) for name, s in seconds.items()},
            "top1_agreement": {name: hits / steps for name, hits in agree.items()},
            "block_ms": {name: [1e3 * statistics.fmean(s[i:i + block])
                                for i in range(0, len(s), block)] for name, s in seconds.items()}}


def new_cache(model, policy: str, device: int, host: int, disk_dir: Path) -> TieredCache:
    """A TieredCache over an emptied ``disk_dir`` with the bench's budgets and selection."""
    shutil.rmtree(disk_dir, ignore_errors=True)
    config = TierConfig(device_budget=device, host_budget=host, disk_dir=disk_dir)  # model's device
    select = SelectConfig(budget=SELECT, fetch_unit=FETCH_UNIT)
    cache = TieredCache(model, config, policy, select=select, chunks=CHUNKS)
    if FETCH_AHEAD is not None:
        cache.fetch_ahead = FETCH_AHEAD
    return cache


def drop_disk(cache: TieredCache) -> None:
    cache.store.disk.flush()
    for seg in Path(cache.store.disk.path).glob("seg-*.tkv"):
        drop_page_cache(seg)


def tiered_case(model, ids, ref, steps, policy, device, host, disk_dir: Path) -> dict:
    """One TieredCache case; raises the device budget on TierFullError or a selection cut to fit."""
    kv = KVShape.from_config(model.config, dtype=model.dtype).kv_bytes(ids.shape[1] + steps)
    retries = []
    while True:
        cache = new_cache(model, policy, device, host, disk_dir)
        marks = {}

        def on_prefill():
            drop_disk(cache)
            marks.update(stats_marks(cache.stats()))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeviceBudgetWarning)
                probs, seconds = run_decode(model, cache, ids, ref, steps, on_prefill, label=policy)
        except (TierFullError, DeviceBudgetWarning) as err:
            cache.close()
            if device >= kv:
                return {"error": f"{type(err).__name__}: {err}", "device_budget_tried": retries + [device]}
            retries.append(device)
            device = min(kv, raised(device, str(err)))
            continue
        stats, fetch_ahead = cache.stats(), cache.fetch_ahead
        cache.close()
        end = stats_marks(stats)
        out = case_figures(probs, seconds, ref)
        out.update({"disk_bytes_per_token": (end["disk"] - marks["disk"]) / steps,
                    "device_peak_bytes": stats["device_peak_bytes"],
                    "stall_frac": ratio(end["stall"] - marks["stall"], end["step"] - marks["step"]),
                    "device_budget": device, "device_budget_raised_from": retries or None,
                    "host_budget": host, "device_budget_violated": stats["device_peak_bytes"] > device,
                    "fetch_ahead": fetch_ahead,
                    "tier_bytes_end": {k: stats.get(f"{k}_bytes") for k in ("device", "host", "disk")}})
        return out


def raised(device: int, message: str) -> int:
    """The next device budget after a TierFullError or DeviceBudgetWarning: the shortfall it
    names, at least 10 % more, rounded up to a MiB."""
    found = re.search(r"needs (\d+) B, (-?\d+) B free", message)
    short = int(found.group(1)) - int(found.group(2)) if found else 0
    wanted = re.search(r"a device budget of (\d+) B", message)
    if wanted:
        short = int(wanted.group(1)) - device
    return -(-max(device + short, int(1.1 * device)) // 2**20) * 2**20


def stats_marks(stats: dict) -> dict:
    total = stats.get("pipeline_total", {})
    return {"disk": stats["disk_bytes_read"], "stall": total.get("stall_s", 0.0),
            "step": total.get("step_s", 0.0)}


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def case_figures(probs, seconds, ref) -> dict:
    """ms/token and, against the reference's log-probabilities ``ref`` (none: ``None``s), the
    decode steps' top-1 agreement, KL divergence and misses (``bench.common.divergence``; the
    prediction after prefill is left out)."""
    figures = {"top1_agreement": None, "kl": None, "top1_misses": None} if ref is None else \
        divergence(ref[1:], probs[1:])
    return {"ms_per_token": 1e3 * sum(seconds) / len(seconds), **figures}


def full_memory_case(model, ids, steps) -> tuple[dict, torch.Tensor]:
    probs, seconds = run_decode(model, DynamicCache(), ids, None, steps, label="full_memory")
    out = case_figures(probs, seconds, probs)
    out.update({"disk_bytes_per_token": 0.0, "device_peak_bytes": None, "stall_frac": None})
    return out, probs


def offloaded_case(model, ids, ref, steps) -> dict:
    """transformers' ``DynamicCache(offloading=True)``, teacher-forced like the tiered cases.
    It moves a GPU's KV to CPU RAM (never to disk), so without the model on a GPU the case is
    ``{"skipped": why}``. ``gpu_peak_over_start_bytes``: the GPU's peak allocation during the
    case above what was allocated before it (the model's weights)."""
    gpu = getattr(model, "device", torch.device("cpu"))
    if gpu.type != "cuda":
        return {"skipped": "transformers offloads a GPU's KV to CPU RAM: needs the model on a GPU"}
    torch.cuda.synchronize(gpu)
    start = torch.cuda.memory_allocated(gpu)
    torch.cuda.reset_peak_memory_stats(gpu)
    try:  # another library's path, not yet run here on a GPU: its failure is a figure, not a crash
        probs, seconds = run_decode(model, DynamicCache(offloading=True), ids, ref, steps,
                                    label="offloaded")
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    out = case_figures(probs, seconds, ref)
    out.update({"disk_bytes_per_token": 0.0, "device_peak_bytes": None, "stall_frac": None,
                "gpu_peak_over_start_bytes": torch.cuda.max_memory_allocated(gpu) - start})
    return out


def warm_up(model, tok, root: Path) -> None:
    ids = document_ids(tok, 256, seed=1)
    run_decode(model, DynamicCache(), ids, None, 2)
    tiered_case(model, ids, None, 2, "tierkv", 64 << 20, 1 << 20, root / "warm")


def print_table(cases: dict) -> None:
    print(f"{'case':<14} {'ms/tok':>8} {'disk MB/tok':>12} {'dev peak MB':>12} {'stall':>6} "
          f"{'top1':>6} {'KL':>7}")
    for name, c in cases.items():
        if "error" in c or "skipped" in c:
            print(f"{name:<14} {'error' if 'error' in c else 'skipped'}: "
                  f"{c.get('error', c.get('skipped'))[:60]}")
            continue
        peak, stall, kl = c["device_peak_bytes"], c["stall_frac"], c.get("kl")
        print(f"{name:<14} {c['ms_per_token']:8.1f} {c['disk_bytes_per_token'] / 1e6:12.2f} "
              f"{'-' if peak is None else f'{peak / 1e6:.1f}':>12} "
              f"{'-' if stall is None else f'{stall:.3f}':>6} {c['top1_agreement']:6.3f} "
              f"{'-' if kl is None else f'{kl:.4f}':>7}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2K tokens, 16 decode steps")
    parser.add_argument("--cases", nargs="+", choices=("brute_offload", "offloaded") + SPARSE,
                        help="run only these cases beside full_memory (for profiling; the "
                             "result file is not written)")
    parser.add_argument("--chunk-min", type=int, metavar="N",
                        help="with --cases: the adaptive trees split leaves down to N tokens "
                             f"(ChunkConfig.min, default {ChunkConfig().min})")
    parser.add_argument("--fetch-unit", choices=("record", "leaf"),
                        help="with --cases: what omnikv/tierkv fill the budget with "
                             "(SelectConfig.fetch_unit, default record)")
    parser.add_argument("--fetch-ahead", choices=("on", "off", "both"),
                        help="with --cases: TieredCache.fetch_ahead (default: on on a GPU, off "
                             "on a CPU); both: with --cases tierkv, also decode tierkv with it "
                             "on and off and full_memory in alternating blocks, in one process")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="with --cases: profile each case's decode steps with torch.profiler "
                             "into DIR/<case>.txt and DIR/<case>.trace.json")
    args = parser.parse_args(argv)
    if args.profile is not None:
        if not args.cases:
            parser.error("--profile is a profiling option: give --cases too")
        global PROFILE
        PROFILE = args.profile
    if args.fetch_unit is not None:
        if not args.cases:
            parser.error("--fetch-unit is a profiling option: give --cases too")
        global FETCH_UNIT
        FETCH_UNIT = args.fetch_unit
    if args.fetch_ahead is not None:
        if not args.cases:
            parser.error("--fetch-ahead is a profiling option: give --cases too")
        if args.fetch_ahead == "both" and "tierkv" not in args.cases:
            parser.error("--fetch-ahead both compares tierkv's runs: give --cases tierkv")
        global FETCH_AHEAD
        FETCH_AHEAD = {"on": True, "off": False}.get(args.fetch_ahead)
    if args.chunk_min is not None:
        if not args.cases:
            parser.error("--chunk-min is a profiling option: give --cases too")
        global CHUNKS
        try:
            CHUNKS = ChunkConfig(min=args.chunk_min, base=max(args.chunk_min, ChunkConfig().base))
        except ValueError as err:
            parser.error(f"--chunk-min {args.chunk_min}: {err}")
    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m", device=str(bench_device()))
    steps = 16 if args.quick else 64
    tokens = 2048 if args.quick else model.config.max_position_embeddings - steps
    ids = document_ids(tok, tokens, seed=0)
    kv = KVShape.from_config(model.config, dtype=model.dtype).kv_bytes(tokens)
    device, host = int(DEVICE_SHARE * kv), int(HOST_SHARE * kv)
    config = {"tokens": tokens, "steps": steps, "model": "smollm2-135m", "dtype": str(model.dtype),
              "kv_bytes": kv, "device_budget": device, "device_budget_frac": DEVICE_SHARE,
              "host_budget": host, "host_budget_frac": HOST_SHARE, "brute_host_budget": BRUTE_HOST,
              "select_budget": SELECT, "threads": torch.get_num_threads()}
    root = Path(tempfile.mkdtemp(prefix="tierkv-bench-decode-"))
    try:
        warm_up(model, tok, root)
        cases = {}
        cases["full_memory"], ref = full_memory_case(model, ids, steps)
        fed = ref.argmax(-1).to(ids.device)  # the paired runs' tokens
        print(f"full_memory: {cases['full_memory']['ms_per_token']:.1f} ms/token", flush=True)
        wanted = args.cases or RUN_ORDER
        paired = compared = None
        for name in (n for n in RUN_ORDER if n in wanted):
            if name == "brute_offload":
                cases[name] = tiered_case(model, ids, ref, steps, "full", device, BRUTE_HOST,
                                          root / "brute")
            elif name == "offloaded":
                cases[name] = offloaded_case(model, ids, ref, steps)
            else:
                cases[name] = tiered_case(model, ids, ref, steps, name, device, host, root / name)
            print(f"{name}: {cases[name].get('ms_per_token', cases[name].get('skipped', 'error'))}"
                  " ms/token", flush=True)
            if name == "tierkv" and "error" not in cases["tierkv"]:
                plain, _ = load_model("smollm2-135m", device=str(bench_device()))
                paired = paired_speed(model, plain, ids, fed, steps, "tierkv",
                                      cases["tierkv"]["device_budget"], host, root / "paired")
                del plain
                print(f"paired: {paired}", flush=True)
                if args.fetch_ahead == "both":
                    models = [model] + [load_model("smollm2-135m", device=str(bench_device()))[0]
                                        for _ in range(2)]
                    compared = paired_ahead(models, ids, fed, steps,
                                            cases["tierkv"]["device_budget"], host, root)
                    del models
                    print(f"fetch_ahead: {compared}", flush=True)
            if not args.cases:  # what a run cut short (a GPU lent for minutes) still leaves
                write_result("decode.partial", {**summary(cases, paired, config), "partial": True},
                             args.quick)
        again, _ = full_memory_case(model, ids, steps)
        runs = [cases["full_memory"]["ms_per_token"], again["ms_per_token"]]
        cases["full_memory"].update({"ms_per_token": sum(runs) / 2, "ms_per_token_runs": runs})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    drift = runs[1] / runs[0]
    print(f"full_memory: {runs[0]:.1f} then {runs[1]:.1f} ms/token (drift {drift:.3f})")
    if args.cases:
        print_table(cases)
        return {"cases": cases, "fetch_ahead": compared}
    result = {**summary(cases, paired, config), "full_memory_drift": drift}
    print_table(cases)
    print({k: result[k] for k in ("speedup_vs_full_memory", "speedup_vs_brute_offload",
                                  "speedup_vs_offloaded", "disk_read_frac", "full_memory_drift")})
    print(write_result("decode", result, args.quick))
    result_path("decode.partial", args.quick).unlink(missing_ok=True)  # the complete run replaces it
    return result


def summary(cases: dict, paired: dict | None, config: dict) -> dict:
    """The result file's figures from the cases run so far (None for those that need a case
    not run, or one that failed)."""
    tk, full, brute, offloaded = (cases.get(n, {"error": "not run"})
                                  for n in ("tierkv", "full_memory", "brute_offload", "offloaded"))
    ok = "error" not in tk
    return {"config": config, "cases": cases,
            "speedup_vs_full_memory": paired["speedup"] if paired else None,
            "speedup_vs_full_memory_unpaired": full["ms_per_token"] / tk["ms_per_token"] if ok else None,
            "paired": paired,
            "speedup_vs_brute_offload": (brute["ms_per_token"] / tk["ms_per_token"]
                                         if ok and "error" not in brute else None),
            "speedup_vs_offloaded": (offloaded["ms_per_token"] / tk["ms_per_token"]
                                     if ok and "ms_per_token" in offloaded else None),
            "disk_read_frac": tk["disk_bytes_per_token"] / config["kv_bytes"] if ok else None}


if __name__ == "__main__":
    main()
