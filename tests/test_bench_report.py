"""Unit tests of bench/report.py: the results table from small fake JSON."""
import json

import pytest

from bench.report import BEGIN, END, fmt, load, render, update_readme
from tierkv.cli import BENCH_DIR, benchmarks

MACHINE = {"cpus": 2, "gpu": None, "torch": "2.x", "platform": "Linux", "when": "today"}


def fake_results() -> dict:
    return {
        "storage": {"machine": MACHINE, "raw_read_gbps": 1.5, "record_read_gbps": 1.2,
                    "read_ratio": 0.8, "write_ratio": 0.9},
        "decode": {"machine": MACHINE, "speedup_vs_full_memory": 0.5, "speedup_vs_brute_offload": 3.0,
                   "paired": {"ms_per_token": {"full_memory": 10.0, "tierkv": 20.0}, "block_steps": 8,
                              "block_speedups": [0.52, 0.45, 0.5, 0.6]},
                   "disk_read_frac": 0.02, "config": {"tokens": 2048, "steps": 16, "kv_bytes": 1000,
                                                      "device_budget_frac": 0.05, "host_budget_frac": 0.2},
                   "cases": {"full_memory": {"ms_per_token": 10.0, "top1_agreement": 1.0,
                                             "disk_bytes_per_token": 0.0, "stall_frac": None},
                             "tierkv": {"ms_per_token": 5.0, "top1_agreement": 0.9, "stall_frac": 0.1,
                                        "kl": 0.0526, "top1_misses": [[10, 0.93], [49, 0.38]],
                                        "disk_bytes_per_token": 1e6, "device_budget": 56,
                                        "device_budget_raised_from": [50]},
                             "h2o": {"error": "TierFullError: boom"}}},
        "scale": {"machine": MACHINE, "sizes": {"16384": {"step_over_physical_bound": 1.7, "step_s": 0.2,
                                                          "step_over_cpu_bound": 1.25, "step_cpu_s": 0.32,
                                                          "brute_over_step": None, "brute_s": None,
                                                          "brute_skipped": "too big", "needle_recall": 1.0,
                                                          "peak_rss_process": 4_830_000_000,
                                                          "host_budget": 4_000_000_000}},
                  "config": {"fixed_select_tokens": 1280},
                  "growth": [{"from": 65536, "to": 262144, "tokens_ratio": 4.0, "step_ratio": 4.36,
                              "step_exponent": 1.06, "fixed_step_ratio": 1.5,
                              "fixed_step_exponent": 0.29}],
                  "not_run": {"1048576": "137 GB of KV"}},
        "mystery": {"machine": MACHINE},
    }


def test_render_rows_and_machine():
    table = render(fake_results())
    lines = table.splitlines()
    assert lines[0] == "| benchmark | figure | value | meaning |"
    assert "| storage | read ratio | 0.8 |" in table
    assert "| decode | speedup vs brute_offload | 3 |" in table
    assert "| decode | speedup vs full_memory | 0.5 | paired run, alternating blocks of 8 " \
           "steps, every other round reversed: 10 / 20 ms/token; pairs of blocks 0.45-0.6 " \
           "(median 0.51) |" in table
    assert "| decode | h2o | - | error: TierFullError: boom |" in table
    reordered = fake_results()  # a file whose paired figures list tierkv first reads the same
    reordered["decode"]["paired"]["ms_per_token"] = {"tierkv": 20.0, "full_memory": 10.0}
    assert "every other round reversed: 10 / 20 ms/token" in render(reordered)
    assert "| decode | tierkv top1 | 0.9 | 5 ms/token, 1 MB disk/token, stall 0.1, device tier 0.056 " \
           "of the KV (raised after TierFullError), KL 0.0526 (misses where the reference's margin " \
           "was 0.38, 0.93) |" in table
    many = fake_results()
    many["decode"]["cases"]["tierkv"]["top1_misses"] = [[i, m] for i, m in
                                                        enumerate([3.0, 0.1, 0.5, 2.0, 0.2], 1)]
    assert "KL 0.0526 (5 misses where the reference's margin was 0.1-3, median 0.5) |" in render(many)
    assert "| decode | full_memory top1 | 1 | 10 ms/token, 0 MB disk/token, stall - |" in table
    assert "| scale | 16384 tok: step / physical bound | 1.7 |" in table
    assert "| scale | 16384 tok: brute / step | - | too big |" in table
    assert "| scale | 16384 tok: peak RSS GB | 4.83 | whole run of the size, torch included; target: " \
           "host budget 4 GB + 1 GB |" in table
    assert "| scale | 16384 tok: step / extent bound | - |" in table
    assert "| scale | 16384 tok: step / CPU bound | 1.25 | the same step vs its process CPU time / " \
           "cores (320 ms of CPU a step) |" in table
    assert "not run: 137 GB of KV" in table
    assert "| scale | 65536 -> 262144 tok: step growth exponent | 1.06 | log(step ratio 4.36) / " \
           "log(context ratio 4); < 1 is sub-linear." in table
    assert "| scale | 65536 -> 262144 tok: step growth exponent, fixed budget | 0.29 | the same " \
           "with 1280 tokens a group at every size (step ratio 1.5) |" in table
    assert "| mystery | - | - | no renderer for this file |" in table
    assert table.count("Machine: 2 CPUs, no GPU") == 1   # one machine, described once



def test_codecs_render_ratio_error_and_native_speedups():
    table = render({"codecs": {
        "codecs": {"float16": {"raw": {"ratio": 1.0, "rel_err": 0.0, "decode_gbps": 3.8,
                                       "encode_gbps": 1.0},
                               "int8": {"ratio": 1.78, "rel_err": 0.004, "decode_gbps": 0.03,
                                        "encode_gbps": 0.02}}},
        "native": {"shuffle": {"speedup": 8.3, "native_gbps": 15.1, "fallback_gbps": 1.8}}}})
    assert "| codecs | float16 raw ratio | 1 | raw / stored bytes; decode 3.8 GB/s, encode 1 GB/s, " \
           "lossless |" in table
    assert "| codecs | float16 int8 ratio | 1.78 | " in table and "relative error 0.004 |" in table
    assert "| codecs | native shuffle speedup | 8.3 | 15.1 against 1.8 GB/s (Python fallback) |" in table
    assert "no renderer" not in table

def test_render_orders_benchmarks():
    table = render(fake_results())
    first = [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("| ")]
    order = list(dict.fromkeys(first))
    assert order == ["storage", "decode", "scale", "mystery"]


def test_a_gpu_run_sits_beside_the_cpu_one(tmp_path, monkeypatch):
    """``<name>.gpu.json`` (a GPU machine's run) renders right after ``<name>``, its rows
    labelled with the GPU, and both machines are described."""
    import bench.common as common

    results = fake_results()
    gpu = {**MACHINE, "gpu": "NVIDIA H100", "device": "cuda:0"}
    results["decode.gpu"] = {**results["decode"], "machine": gpu, "speedup_vs_full_memory": 1.4}
    table = render(results)
    first = [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("| ")]
    assert list(dict.fromkeys(first)) == ["storage", "decode", "decode (NVIDIA H100)", "scale",
                                          "mystery"]
    assert "| decode (NVIDIA H100) | speedup vs full_memory | 1.4 |" in table
    assert "2 CPUs, NVIDIA H100" in table and "2 CPUs, no GPU" in table
    results["decode.partial.gpu"] = {**results["decode.gpu"], "partial": True}
    results["decode.partial"] = {**results["decode"], "partial": True}
    table = render(results)
    assert "| decode (NVIDIA H100, partial: a run cut short) | speedup vs full_memory | 1.4 |" in table
    assert "| decode (partial: a run cut short) |" in table
    results["decode.gpu"]["cases"] = {**results["decode"]["cases"],
                                      "offloaded": {"skipped": "needs the model on a GPU"}}
    assert "| decode (NVIDIA H100) | offloaded | - | not run: needs the model on a GPU |" in render(results)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv("TIERKV_BENCH_DEVICE", "cpu")
    assert common.write_result("x", {}).name == "x.json"
    monkeypatch.setattr(common, "bench_device", lambda: __import__("torch").device("cuda", 0))
    monkeypatch.setattr(common, "machine", lambda: gpu)
    assert common.write_result("x", {}).name == "x.gpu.json"
    monkeypatch.undo()
    monkeypatch.setenv("TIERKV_BENCH_DEVICE", "tpu")
    with pytest.raises(ValueError, match="TIERKV_BENCH_DEVICE='tpu'"):
        common.bench_device()


def test_a_quick_run_never_replaces_a_full_run(tmp_path, monkeypatch):
    """``--quick`` writes ``<name>.quick.json``: the committed full-size figures stay, the table
    shows a quick run only where no full run of that bench (on that kind of machine) exists,
    labelled with its size."""
    import bench.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv("TIERKV_BENCH_DEVICE", "cpu")
    full = common.write_result("decode", {"speedup_vs_full_memory": 1.5})
    quick = common.write_result("decode", {"speedup_vs_full_memory": 0.9}, quick=True)
    assert (full.name, quick.name) == ("decode.json", "decode.quick.json")
    assert json.loads(full.read_text())["speedup_vs_full_memory"] == 1.5
    assert common.result_path("selection", True, ".png").name == "selection.quick.png"
    monkeypatch.setattr(common, "bench_device", lambda: __import__("torch").device("cuda", 0))
    assert common.write_result("scale", {}, quick=True).name == "scale.quick.gpu.json"

    results = fake_results()
    results["decode.quick"] = {**results["decode"], "speedup_vs_full_memory": 0.25}
    results["storage.quick"] = {**results["storage"], "read_ratio": 0.7}
    del results["storage"]
    gpu = {**MACHINE, "gpu": "NVIDIA H100"}
    results["scale.partial.quick.gpu"] = {**results["scale"], "machine": gpu}
    table = render(results)
    assert "| decode | speedup vs full_memory | 0.5 |" in table and "0.25" not in table
    assert "| storage (--quick size) | read ratio | 0.7 |" in table
    assert "| scale (NVIDIA H100, partial: a run cut short, --quick size) | 16384 tok: needle recall | 1 |" in table
    first = [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("| ")]
    assert list(dict.fromkeys(first)) == ["storage (--quick size)", "decode", "scale",
                                          "scale (NVIDIA H100, partial: a run cut short, --quick size)",
                                          "mystery"]


def test_fmt():
    assert fmt(None) == "-" and fmt(True) == "yes" and fmt(0.123456) == "0.123"
    assert fmt(123456.0) == "1.235e+05" and fmt(7) == "7"


def test_update_readme_replaces_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    update_readme(readme, "new table\n")
    assert readme.read_text() == f"intro\n{BEGIN}\nnew table\n{END}\noutro\n"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update_readme(readme, "x")


def test_load_reads_every_json(tmp_path):
    (tmp_path / "storage.json").write_text(json.dumps({"read_ratio": 1.0}))
    (tmp_path / "notes.txt").write_text("ignored")
    assert load(tmp_path) == {"storage": {"read_ratio": 1.0}}


def test_the_readme_runs_every_benchmark_with_its_options():
    """bench/README.md's command table has a row for every benchmark of bench/, with
    ``[--quick]`` when the benchmark takes it."""
    readme = (BENCH_DIR / "README.md").read_text()
    for name in benchmarks():
        quick = " [--quick]" if "--quick" in (BENCH_DIR / f"{name}.py").read_text() else ""
        assert f"| `python -m bench.{name}{quick}" in readme, f"bench.{name} has no row"


@pytest.mark.parametrize("text, message", [('{"machine": ', "not JSON"), ("[1, 2]", "a JSON list, not")])
def test_a_results_file_that_is_no_benchmark_result_is_named(tmp_path, text, message):
    (tmp_path / "good.json").write_text("{}")
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'bad.json'}: {message}"):
        load(tmp_path)

