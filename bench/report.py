"""Regenerate the results table of ``bench/README.md`` from every ``bench/results/*.json``.

    python -m bench.report

Each known result file renders as rows of (benchmark, figure, value, what it is); the rows
replace whatever sits between the two ``RESULTS`` markers of the README. A result file that is
missing is skipped; one without a renderer is listed by name.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
BEGIN, END = "<!-- RESULTS:BEGIN -->", "<!-- RESULTS:END -->"
ORDER = ("storage", "codecs", "selection", "pipeline", "quality", "ceiling", "reopen", "decode",
         "verify", "scale")


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def storage_rows(d: dict) -> list[tuple]:
    return [("raw read GB/s", d.get("raw_read_gbps"), "plain file reads, page cache dropped"),
            ("record read GB/s", d.get("record_read_gbps"), "DiskTier.get_many, same bytes"),
            ("O_DIRECT speedup", d.get("direct_speedup"),
             "DiskTier.get_many with O_DIRECT / through the page cache, records in disk order"),
            ("read ratio", d.get("read_ratio"), "record / raw read speed (target >= 0.8)"),
            ("write ratio", d.get("write_ratio"), "record / raw write speed")]


def codecs_rows(d: dict) -> list[tuple]:
    """Per dtype and codec: ratio (with its error when lossy) and decode speed; the native
    helpers' speedups over their Python fallbacks."""
    rows = []
    for dtype, codecs in d.get("codecs", {}).items():
        for name, c in codecs.items():
            err = c.get("rel_err")
            rows.append((f"{dtype} {name} ratio", c.get("ratio"),
                         f"raw / stored bytes; decode {fmt(c.get('decode_gbps'))} GB/s, encode "
                         f"{fmt(c.get('encode_gbps'))} GB/s"
                         + (f", relative error {fmt(err)}" if err else ", lossless")))
    for name, n in d.get("native", {}).items():
        rows.append((f"native {name} speedup", n.get("speedup"),
                     f"{fmt(n.get('native_gbps'))} against {fmt(n.get('fallback_gbps'))} GB/s "
                     "(Python fallback)"))
    return rows


def selection_rows(d: dict) -> list[tuple]:
    rows = []
    for doc, r in d.get("documents", {}).items():
        adaptive = r.get("cases", {}).get("adaptive", {})
        rows += [(f"{doc}: adaptive/fixed64 bytes", r.get("adaptive_vs_fixed_bytes"),
                  "bytes fetched by the adaptive tree / fixed 64-token chunks, same recall"),
                 (f"{doc}: LKA mass recall", adaptive.get("lka_mass_recall"),
                  "attention mass inside the chunks chosen from summaries / that of the exact "
                  "top-k tokens (target 0.9)"),
                 (f"{doc}: chunk oracle recall", adaptive.get("chunk_oracle_recall"),
                  "the same for leaves chosen by exact scores: the ceiling of any ranking of these leaves"),
                 (f"{doc}: bound-ranking recall", adaptive.get("bound_mass_recall"),
                  "the same with Quest's upper-bound ranking (pruned tree search)")]
        for case in ("adaptive_min4", "adaptive_min8"):
            finer = r.get("cases", {}).get(case)
            if finer:
                config = d.get("config", {}).get("cases", {}).get(case, {})
                rows.append((f"{doc}: LKA mass recall, {case}", finer.get("lka_mass_recall"),
                             f"leaves of {config.get('min')}-{config.get('max')} tokens (default "
                             f"2-512); chunk oracle {finer.get('chunk_oracle_recall', 0):.3f}"))
    return rows


def pipeline_rows(d: dict) -> list[tuple]:
    s = d.get("stall", {})
    rows = [("stall frac", s.get("stall_frac"), "pipelined fetch: share of step time waiting on KV"),
            ("stall frac, sync", s.get("sync_stall_frac"), "same steps, synchronous fetch"),
            ("stall frac, no cache", s.get("stall_frac_no_cache"), "pipeline without its device cache")]
    for case, disks in d.get("codec_choice", {}).items():
        for disk, r in disks.items():
            tolerance = round(100 * r.get("tolerance", 0.1))
            rows.append((f"codec {case} {disk}", r.get("fastest_or_tied"),
                         f"controller's mix within {tolerance} % of the fastest fixed codec the "
                         f"quality floor allows; chose {r.get('chosen')}"))
    return rows


MARGINS_LISTED = 4  # more misses than this are summed up as a range and a median


def kl_text(r: dict) -> str:
    """", KL x" and the reference's margins at the top-1 misses, where the result has them
    (results written before they were measured have not)."""
    if r.get("kl") is None or r.get("top1_agreement") == 1.0 and r.get("kl") == 0.0:
        return ""
    margins = sorted(m for _, m in r.get("top1_misses") or ())
    if not margins:
        at = ""
    elif len(margins) <= MARGINS_LISTED:
        at = f" (misses where the reference's margin was {', '.join(fmt(m) for m in margins)})"
    else:
        at = (f" ({len(margins)} misses where the reference's margin was {fmt(margins[0])}-"
              f"{fmt(margins[-1])}, median {fmt(statistics.median(margins))})")
    return f", KL {fmt(r['kl'])}{at}"


def quality_rows(d: dict) -> list[tuple]:
    rows = []
    for policy, budgets in d.get("policies", {}).items():
        for budget, r in budgets.items():
            if "error" in r:
                rows.append((f"{policy} @ {budget}", None, f"error: {r['error'][:60]}"))
                continue
            rows.append((f"{policy} @ {budget} top1", r.get("top1_agreement"),
                         f"passkey {fmt(r.get('passkey_acc'))}, {fmt(r.get('ms_per_token'))} ms/token"
                         f"{kl_text(r)}"))
    return rows


def ceiling_rows(d: dict) -> list[tuple]:
    rows = []
    for name, budgets in d.get("oracles", {}).items():
        r = budgets.get("0.1", {})
        by = ", ".join(f"{c}: {fmt(v)}" for c, v in r.get("top1_by_context", {}).items())
        kind = ("key-sketch ranking (a method, Loki's)" if "sketch" in name
                else "exact top-k oracle (a ceiling, not a method)")
        moved = ""
        if r.get("moved_tokens") is not None:
            moved = (f"; brings {fmt(r['moved_tokens'])} of a sparse layer's tokens, "
                     f"{fmt(r['moved_chunks'])} of its chunks")
        rows.append((f"{name} @ 0.1 top1", r.get("top1_agreement"), f"{kind}; by context {by}{moved}"))
    return rows


def reopen_rows(d: dict) -> list[tuple]:
    return [("reopen / prefill", d.get("ratio"), "time to reopen a saved document and answer / re-prefill it"),
            ("same first token", d.get("same_first_token"), "reopened answer starts like the re-prefilled one"),
            ("question's disk reads", _share(d.get("question_read_bytes"), d.get("question_whole_read_bytes")),
             "bytes a reopened document's question reads / what it read attending all of the KV")]


def _share(part, whole):
    return None if part is None or not whole else part / whole


def decode_rows(d: dict) -> list[tuple]:
    cfg = d.get("config", {})
    paired = d.get("paired") or {}
    ms = paired.get("ms_per_token") or {}
    how = ("paired run, alternating blocks of {} steps, every other round reversed: {} / {} "
           "ms/token".format(paired.get("block_steps"), fmt(ms.get("full_memory")),
                             fmt(ms.get("tierkv")))
           if ms else "full_memory ms/token / tierkv ms/token")
    blocks = sorted(paired.get("block_speedups") or ())
    if blocks:
        how += "; pairs of blocks {}-{} (median {})".format(
            fmt(blocks[0]), fmt(blocks[-1]), fmt(statistics.median(blocks)))
    rows = [("speedup vs full_memory", d.get("speedup_vs_full_memory"), how),
            ("speedup vs brute_offload", d.get("speedup_vs_brute_offload"), "brute_offload ms/token / tierkv ms/token"),
            ("speedup vs offloaded", d.get("speedup_vs_offloaded"),
             "transformers' offloaded DynamicCache ms/token / tierkv ms/token (not paired; GPU only)"),
            ("tierkv disk read frac", d.get("disk_read_frac"), "disk bytes read per token / whole KV bytes")]
    if d.get("full_memory_drift") is not None:
        runs = d["cases"]["full_memory"].get("ms_per_token_runs") or []
        rows.append(("full_memory drift", d["full_memory_drift"],
                     "machine speed change over the run: full_memory last / first run ("
                     + " then ".join(f"{fmt(r)}" for r in runs) + " ms/token)"))
    for name, c in d.get("cases", {}).items():
        if "error" in c:
            rows.append((name, None, f"error: {c['error'][:60]}"))
            continue
        if "skipped" in c:
            rows.append((name, None, f"not run: {c['skipped']}"))
            continue
        device = ""
        if c.get("device_budget") and cfg.get("kv_bytes"):
            raised = " (raised after TierFullError)" if c.get("device_budget_raised_from") else ""
            device = f", device tier {fmt(c['device_budget'] / cfg['kv_bytes'])} of the KV{raised}"
        rows.append((f"{name} top1", c.get("top1_agreement"),
                     f"{fmt(c.get('ms_per_token'))} ms/token, {fmt(c.get('disk_bytes_per_token', 0) / 1e6)} "
                     f"MB disk/token, stall {fmt(c.get('stall_frac'))}{device}{kl_text(c)}"))
    rows.append(("context", cfg.get("tokens"), f"{cfg.get('steps')} decode steps, device budget "
                 f"{fmt(cfg.get('device_budget_frac'))} / host {fmt(cfg.get('host_budget_frac'))} of the KV"))
    return rows


def verify_rows(d: dict) -> list[tuple]:
    cases = d.get("cases", {})
    step = cases.get("step", {})
    rows = [("step top1", step.get("top1_agreement"),
             f"tierkv, one token a pass: {fmt(step.get('ms_per_pass'))} ms a pass "
             f"(full_memory {fmt(cases.get('full_memory', {}).get('ms_per_pass'))})")]
    for t, s in sorted(d.get("drafts", {}).items(), key=lambda item: int(item[0])):
        verify, question = cases.get(f"verify_{t}", {}), cases.get(f"question_{t}", {})
        rows += [(f"t={t}: verifying pass / step", s.get("pass_cost"),
                  f"{fmt(verify.get('ms_per_pass'))} ms a pass of {t} tokens attended as a decode "
                  f"step; plain transformers' pass / its step: {fmt(s.get('full_memory_pass_cost'))}"),
                 (f"t={t}: as a question / verifying", s.get("speedup_vs_question"),
                  f"the same passes attended as questions (before): "
                  f"{fmt(question.get('ms_per_pass'))} ms a pass"),
                 (f"t={t}: verifying top1", verify.get("top1_agreement"),
                  f"every draft accepted; as questions {fmt(question.get('top1_agreement'))}")]
    cfg = d.get("config", {})
    rows.append(("context", cfg.get("tokens"), f"{cfg.get('continuation')} tokens fed in passes, "
                 "tierkv with bench.decode's budgets"))
    return rows


def _gb(nbytes) -> float | None:
    return None if nbytes is None else nbytes / 1e9


def scale_rows(d: dict) -> list[tuple]:
    rows = []
    for tokens, r in d.get("sizes", {}).items():
        rows += [(f"{tokens} tok: step / physical bound", r.get("step_over_physical_bound"),
                  f"step {fmt(r.get('step_s', 0) * 1e3)} ms vs disk bytes / raw read bandwidth"),
                 (f"{tokens} tok: step / CPU bound", r.get("step_over_cpu_bound"),
                  f"the same step vs its process CPU time / cores "
                  f"({fmt((r.get('step_cpu_s') or 0) * 1e3)} ms of CPU a step)"),
                 (f"{tokens} tok: fetch / physical bound", r.get("fetch_over_physical_bound"),
                  "the step's KVStore.fetch time alone (host and disk records) / the same bound"),
                 (f"{tokens} tok: step / extent bound", r.get("step_over_extent_bound"),
                  "the same step vs plain reads of its own record extents (the disk's limit for "
                  "scattered reads)"),
                 (f"{tokens} tok: peak RSS GB", _gb(r.get("peak_rss_process")),
                  f"whole run of the size, torch included; target: host budget "
                  f"{fmt(_gb(r.get('host_budget')))} GB + 1 GB"),
                 (f"{tokens} tok: brute / step", r.get("brute_over_step"),
                  "reading every record / the selective step" if r.get("brute_s") else r.get("brute_skipped")),
                 (f"{tokens} tok: needle recall", r.get("needle_recall"), "planted needle chunks selected")]
    fixed = d.get("config", {}).get("fixed_select_tokens")
    for g in d.get("growth", []):
        span = f"{g['from']} -> {g['to']} tok"
        rows += [(f"{span}: step growth exponent", g.get("step_exponent"),
                  f"log(step ratio {fmt(g.get('step_ratio'))}) / log(context ratio "
                  f"{fmt(g.get('tokens_ratio'))}); < 1 is sub-linear. A budget of 2 % of the "
                  "context reads bytes in proportion to it"),
                 (f"{span}: step growth exponent, fixed budget", g.get("fixed_step_exponent"),
                  f"the same with {fixed} tokens a group at every size (step ratio "
                  f"{fmt(g.get('fixed_step_ratio'))})")]
    for tokens, why in d.get("not_run", {}).items():
        rows.append((f"{tokens} tok", None, f"not run: {why}"))
    return rows


RENDERERS = {"storage": storage_rows, "codecs": codecs_rows, "selection": selection_rows,
             "pipeline": pipeline_rows, "quality": quality_rows, "ceiling": ceiling_rows,
             "reopen": reopen_rows, "decode": decode_rows, "verify": verify_rows,
             "scale": scale_rows}


def render(results: dict[str, dict]) -> str:
    """The markdown table (and machine line) of ``results``: {bench name: parsed JSON}."""
    lines = ["| benchmark | figure | value | meaning |", "|---|---|---|---|"]

    def order(name: str):  # "decode.gpu" (a GPU machine's run) right after "decode"
        base, _, variant = name.partition(".")
        return (ORDER.index(base) if base in ORDER else len(ORDER), base, variant)

    shown = [name for name in results if not superseded(name, results)]
    for name in sorted(shown, key=order):
        base = name.partition(".")[0]
        label = variant_label(name, results[name].get("machine", {}).get("gpu"))
        renderer = RENDERERS.get(base)
        if renderer is None:
            lines.append(f"| {label} | - | - | no renderer for this file |")
            continue
        for figure, value, meaning in renderer(results[name]):
            lines.append(f"| {label} | {figure} | {fmt(value)} | {meaning or ''} |")
    machines = {}
    for r in results.values():
        m = r.get("machine", {})
        if m:
            machines.setdefault(describe(m), []).append(m.get("when", "?"))
    described = "; ".join(f"{d} (runs {min(w)} to {max(w)})" for d, w in sorted(machines.items()))
    return "\n".join(lines) + (f"\n\nMachine: {described}\n" if described else "\n")


def superseded(name: str, results: dict) -> bool:
    """A quick run's file (``decode.quick.json``) beside the same bench's full run on the same
    kind of machine (``decode.json``): the table shows the full run only."""
    parts = name.split(".")
    return "quick" in parts and ".".join(p for p in parts if p != "quick") in results


def variant_label(name: str, gpu: str | None) -> str:
    """``decode`` as is; ``decode.partial.quick.gpu`` as ``decode (NVIDIA H100, partial: a run cut
    short, --quick size)``."""
    base, *flags = name.split(".")
    notes = {"gpu": gpu or "gpu", "partial": "partial: a run cut short", "quick": "--quick size"}
    said = [notes[f] for f in ("gpu", "partial", "quick") if f in flags]
    said += [f for f in flags if f not in notes]
    return f"{base} ({', '.join(said)})" if said else base


def describe(m: dict) -> str:
    gpu = m.get("gpu") or "no GPU"
    return f"{m.get('cpus')} CPUs, {gpu}, torch {m.get('torch')}, {m.get('platform')}"


def load(results_dir: Path) -> dict[str, dict]:
    """Every ``*.json`` of ``results_dir`` by name; ValueError naming a file that is not a JSON
    object."""
    results = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            results[path.stem] = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not JSON ({exc}); rerun its benchmark or remove it") from None
        if not isinstance(results[path.stem], dict):
            raise ValueError(f"{path}: a JSON {type(results[path.stem]).__name__}, not the object a "
                             "benchmark writes; rerun its benchmark or remove it")
    return results


def update_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme}: missing the {BEGIN} / {END} markers")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the results table of bench/README.md "
                                     "from bench/results/*.json (and print it).")
    parser.parse_args(argv)
    try:
        table = render(load(HERE / "results"))
    except ValueError as exc:
        parser.exit(2, f"bench.report: {exc}\n")
    update_readme(HERE / "README.md", table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
