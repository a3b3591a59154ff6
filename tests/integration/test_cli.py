"""The ``tierkv`` command as a user runs it: subprocesses with the real model on a short document
(generate, --save / --load, inspect --plot, a corrupt store), and the input errors that stop it
before any model is loaded, through the same ``main`` in this process."""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.cli import describe, main
from tierkv.storage import CorruptRecordError, DiskTier, DiskWriteError, StorageError
from tierkv.textgen import make_document, passkey_fact
from tierkv.hf.model import cache_kwargs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SEED = 1  # at 700 tokens SmolLM2 finds this document's pass key through the tierkv policy
BUDGETS = ["--device-budget", "8MB", "--host-budget", "8MB", "--max-new-tokens", "6"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                 os.environ.get("PYTHONPATH")]))}


def tierkv(*args, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m tierkv.cli ARGS`` in ``cwd``; the completed process (text output)."""
    return subprocess.run(command(*args), cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=ENV)


def command(*args) -> list[str]:
    """The command line of ``python -m tierkv.cli ARGS``."""
    return [sys.executable, "-m", "tierkv.cli", *map(str, args)]


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def case(model_and_tok, tmp_path_factory):
    """A ~700-token document with a pass key, the question, and its answer."""
    _, tok = model_and_tok
    fact = passkey_fact(random.Random(SEED))
    work = tmp_path_factory.mktemp("cli")
    (work / "doc.txt").write_text(make_document(tok, 700, SEED, [fact]))
    return work, fact


@pytest.fixture(scope="module")
def saved(case):
    """``generate --save``: a fresh prefill that answers and saves the document."""
    work, fact = case
    run = tierkv("generate", "--file", "doc.txt", "--question", fact.question, "--answer-prefix",
                 fact.answer_prefix, "--disk-dir", "disk", "--save", "saved", *BUDGETS, cwd=work)
    assert run.returncode == 0, run.stderr
    return work, fact, run


def test_generate_streams_answer_and_reports(saved):
    work, fact, run = saved
    assert run.stdout.startswith(fact.answer_prefix)
    assert fact.answer in run.stdout
    assert "selection" in run.stderr and "tierkv, budget 0.1, record units" in run.stderr
    for row in ("prefill", "decode", "KV on device", "KV on host", "KV on disk",
                "disk read / token", "stall fraction"):
        assert row in run.stderr, f"{row!r} missing from the report:\n{run.stderr}"
    assert "prefill" in run.stderr and "layer" in run.stderr  # the layer-wise progress bar
    assert (work / "saved" / "manifest.safetensors").is_file()


def test_load_answers_like_a_fresh_prefill(saved):
    work, fact, fresh = saved
    run = tierkv("generate", "--load", "saved", "--question", fact.question, "--answer-prefix",
                 fact.answer_prefix, *BUDGETS, cwd=work)
    assert run.returncode == 0, run.stderr
    assert run.stdout == fresh.stdout
    assert "reopen" in run.stderr and "no prefill" in run.stderr


def test_inspect_and_plot(saved):
    work, _, _ = saved
    run = tierkv("inspect", "saved", "--plot", "tree.png", cwd=work)
    assert run.returncode == 0, run.stderr
    assert "saved document: model smollm2-135m" in run.stdout
    assert "records read back and verified" in run.stdout
    assert "layer groups" in run.stdout
    assert "; tree: " in run.stdout and "leaves of" in run.stdout  # the saved chunk tree
    assert (work / "tree.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_counts_a_damaged_manifest_and_has_nothing_to_plot_in_an_empty_store(saved,
                                                                                     tmp_path):
    """A manifest that cannot be read leaves the saved documents unopenable: not whole (1). A
    store with no document has nothing to draw: one line, 2."""
    work, _, _ = saved
    broken = tmp_path / "manifest"
    shutil.copytree(work / "saved", broken)
    (broken / "manifest.safetensors").write_bytes(b"\0" * 64)
    inspect = tierkv("inspect", broken, cwd=work)
    assert inspect.returncode == 1 and "manifest corrupt" in inspect.stdout, inspect.stdout
    (tmp_path / "empty").mkdir()
    DiskTier(tmp_path / "empty").close()
    run = tierkv("inspect", tmp_path / "empty", "--plot", tmp_path / "x.png", cwd=work)
    assert run.returncode == 2 and last_line(run.stderr).endswith("holds no document to draw")
    (tmp_path / "file").write_text("")
    run = tierkv("inspect", work / "saved", "--plot", tmp_path / "file" / "x.png", cwd=work)
    assert run.returncode == 2 and f"--plot {tmp_path / 'file'}: cannot be created, it exists " \
        "and is not a directory" in last_line(run.stderr), run.stderr


def test_corrupt_store(saved, tmp_path):
    work, fact, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(work / "saved", broken)
    segment = sorted(broken.glob("seg-*.tkv"))[0]
    data = bytearray(segment.read_bytes())
    for offset in range(len(data) // 3, len(data) // 3 + 64):  # inside some record's payload
        data[offset] ^= 0xFF
    segment.write_bytes(bytes(data))
    inspect = tierkv("inspect", broken, cwd=work)
    assert inspect.returncode == 1
    assert "DAMAGED" in inspect.stdout or "dropped" in inspect.stdout
    # a question attending the whole KV reads the damaged record: one line, exit 2
    run = tierkv("generate", "--load", broken, "--question", fact.question, *BUDGETS,
                 "--question-tokens", "0", cwd=work)
    assert run.returncode == 2
    assert last_line(run.stderr).startswith("tierkv: error: "), run.stderr
    assert "Traceback" not in run.stderr
    # through the selection it reads the record only if chosen: an answer, or the same error
    run = tierkv("generate", "--load", broken, "--question", fact.question, *BUDGETS, cwd=work)
    assert run.returncode in (0, 2) and "Traceback" not in run.stderr, run.stderr
    if run.returncode == 2:
        assert last_line(run.stderr).startswith("tierkv: error: "), run.stderr


def run_main(args: list[str], capsys) -> tuple[int, str]:
    """``tierkv ARGS`` in this process (what the console script calls): (status, stderr)."""
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    return status, capsys.readouterr().err


def test_error_in_a_subprocess(case):
    work, _ = case
    run = tierkv("generate", "--file", "doc.txt", "--question", "q", "--policy", "best", cwd=work)
    assert run.returncode == 2
    assert last_line(run.stderr).startswith("tierkv: error: argument --policy: invalid choice")


# The other error cases run in-process, through the same ``main``: each fails before any model
# is loaded, and a subprocess would spend its time importing torch.
@pytest.mark.parametrize("args, message", [
    (["generate", "--file", "absent.txt", "--question", "q"], "no such file"),
    (["generate", "--file", "doc.txt", "--question", "q", "--device-budget", "12XB"], "12XB"),
    (["generate", "--file", "doc.txt", "--question", "q", "--host-budget", "-1"], "-1"),
    (["generate", "--model", "no-such-model", "--file", "doc.txt", "--question", "q"],
     "not a known model"),
    (["generate", "--load", "absent-dir", "--question", "q"], "no such directory"),
    (["generate", "--file", "doc.txt", "--question", "q", "--save", "doc.txt"], "not an empty"),
    (["generate", "--file", "doc.txt", "--question", "q", "--budget", "0"], "--budget: 0: must be"),
    (["generate", "--file", "doc.txt", "--question", "q", "--budget", "2.5"], "whole number"),
    (["generate", "--file", "doc.txt", "--question", "q", "--fetch-unit", "token"], "invalid choice"),
    (["generate", "--file", "doc.txt", "--question", "q", "--question-tokens", "300"],
     "--question-tokens: 300: must be in [0, 256]"),
    (["inspect", "absent-dir"], "no such directory"),
    (["bench", "no-such-bench"], "unknown benchmark"),
])
def test_errors_are_one_line(case, monkeypatch, capsys, args, message):
    work, _ = case
    monkeypatch.chdir(work)
    status, err = run_main(args, capsys)
    assert status == 2
    line = last_line(err)
    assert line.startswith("tierkv: error: ") and message in line, err
    assert "Traceback" not in err


def test_budget_and_fetch_unit_reach_the_cache(case, monkeypatch, capsys, tmp_path):
    """--budget, --fetch-unit and --question-tokens set the SelectConfig a run uses and saves; with --load they
    replace only what they name of the saved one."""
    from tierkv.hf.cache import TieredCache
    from tierkv.hf.persist import saved_select

    work, fact = case
    monkeypatch.chdir(work)
    args = ["--question", fact.question, "--answer-prefix", fact.answer_prefix, *BUDGETS]
    status, err = run_main(["generate", "--file", "doc.txt", "--budget", "0.2", "--fetch-unit",
                            "leaf", "--save", str(tmp_path / "s"), *args], capsys)
    assert status == 0, err
    saved = saved_select(tmp_path / "s")
    assert (saved.budget, saved.fetch_unit) == (0.2, "leaf")
    opened = []
    real_open = TieredCache.open.__func__
    monkeypatch.setattr(TieredCache, "open", classmethod(
        lambda cls, *a, **kw: opened.append(kw["select"]) or real_open(cls, *a, **kw)))
    status, err = run_main(["generate", "--load", str(tmp_path / "s"), "--budget", "0.15",
                            "--question-tokens", "0", *args], capsys)
    assert status == 0, err
    assert opened == [saved.__class__(budget=0.15, fetch_unit="leaf", question_tokens=0)]


def test_a_directory_without_manifest(case, monkeypatch, capsys, tmp_path):
    """Segments but no manifest (a run that never saved): --load says why it cannot answer,
    inspect shows the records."""
    import torch

    from tierkv.storage import DiskTier, KVBlock, RecordKey

    key = RecordKey("doc", 0, 0, 4)
    with DiskTier(tmp_path / "run") as tier:
        tier.put(key, KVBlock(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)))
    (tmp_path / "run" / "manifest.safetensors").unlink()
    status, err = run_main(["generate", "--load", str(tmp_path / "run"), "--question", "q"], capsys)
    assert status == 2 and "has segment files but no manifest.safetensors" in last_line(err)
    assert main(["inspect", str(tmp_path / "run")]) == 0
    assert "all 1 records read back and verified" in capsys.readouterr().out
    assert not (tmp_path / "run" / "manifest.safetensors").exists()  # inspect only looks


def test_debug_raises(case, monkeypatch):
    work, _ = case
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match="no such file"):
        main(["generate", "--file", "absent.txt", "--question", "q", "--debug"])


def test_full_disk_and_corrupt_messages():
    full = DiskWriteError("writing 4096 B to seg-000001.tkv failed")
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert describe(full).startswith("disk full: writing 4096 B")
    assert describe(OSError(errno.ENOSPC, "No space left on device")).startswith("disk full")
    assert describe(CorruptRecordError("record x: crc mismatch")).startswith("corrupt store: record x")
    fetch = StorageError("group 3: record doc0/g3/[0,16) could not be fetched")
    fetch.__cause__ = CorruptRecordError("crc mismatch")
    assert describe(fetch).startswith("corrupt store: group 3")


def no_model(name):
    pytest.fail(f"the model {name!r} was loaded: the input error should have come first")


@pytest.fixture(scope="module")
def two_docs(model_and_tok, tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """A directory holding two saved documents, ``short`` and ``long``: (path, tokens of each)."""
    import torch

    from tierkv import TierConfig, TieredCache

    model, tok = model_and_tok
    path, tokens = tmp_path_factory.mktemp("two") / "saved", {}
    for doc, text in (("short", "A short text. " * 20), ("long", "A longer text. " * 40)):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full",
                         doc=doc) as cache, torch.no_grad():
            model(ids, **cache_kwargs(model, cache), use_cache=True)
            cache.save(path)
        tokens[doc] = ids.shape[1]
    return path, tokens


def test_load_of_several_documents_takes_doc(two_docs, monkeypatch, capsys, tmp_path):
    """With several saved documents --load needs --doc, and says so before the model loads,
    naming them; an unknown --doc names those there are; --doc NAME reopens that one."""
    from tierkv import cli_generate

    path, tokens = two_docs
    args = ["generate", "--load", str(path), "--question", "How long is the text?", *BUDGETS]
    monkeypatch.setattr(cli_generate, "_load", no_model)
    status, err = run_main(args, capsys)
    assert status == 2 and last_line(err) == (f"tierkv: error: --load {path}: holds 2 saved "
                                              "documents (long, short): choose one with --doc NAME")
    status, err = run_main([*args, "--doc", "medium"], capsys)
    assert status == 2 and last_line(err) == (f"tierkv: error: --doc medium: {path} holds no saved "
                                              "document of that name (it holds long, short)")
    (tmp_path / "doc.txt").write_text("A text.")
    status, err = run_main(["generate", "--file", str(tmp_path / "doc.txt"), "--doc", "short",
                            "--question", "q"], capsys)
    assert status == 2 and "--doc without --load" in last_line(err)
    monkeypatch.undo()
    status, err = run_main([*args, "--doc", "short"], capsys)
    assert status == 0, err
    assert f"{tokens['short']} tokens in" in err and "(no prefill)" in err


def test_load_of_a_damaged_manifest_says_where_it_went(saved, monkeypatch, capsys, tmp_path):
    """Opening a directory whose manifest is damaged sets it aside: --load says so, and where,
    before the model loads, then and on the next run."""
    from tierkv import cli_generate

    work, fact, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(work / "saved", broken)
    (broken / "manifest.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setattr(cli_generate, "_load", no_model)
    for _ in range(2):
        status, err = run_main(["generate", "--load", str(broken), "--question", "q"], capsys)
        assert status == 2 and (f"holds no saved document: its manifest was found damaged and "
                                f"moved aside to {broken / 'manifest.corrupt-1.safetensors'}"
                                in last_line(err)), err
    assert (broken / "manifest.corrupt-1.safetensors").read_bytes() == b"\0" * 64


def test_load_of_a_run_never_saved_speaks_of_options(monkeypatch, capsys, tmp_path):
    """A run's disk tier without a saved document: --load names the option that saves one, not
    the library call."""
    import torch

    from tierkv import cli_generate
    from tierkv.storage import KVBlock, RecordKey

    with DiskTier(tmp_path / "run") as tier:
        tier.put(RecordKey("doc0", 0, 0, 4), KVBlock(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)))
    monkeypatch.setattr(cli_generate, "_load", no_model)
    status, err = run_main(["generate", "--load", str(tmp_path / "run"), "--question", "q"], capsys)
    assert status == 2 and last_line(err).endswith("holds no saved document (the disk tier of a "
                                                   "run without --save?); save one with --save DIR")


def test_save_into_a_directory_written_during_the_prefill(case, monkeypatch, capsys, tmp_path):
    """--save DIR was empty when checked; another run that writes there during the prefill is
    met by the CLI's own check, not by the library's advice."""
    import torch

    from tierkv import cli_generate
    from tierkv.storage import KVBlock, RecordKey

    work, fact = case
    monkeypatch.chdir(work)
    save, prefill = tmp_path / "save", cli_generate.prefill

    def raced(model, cache, ids):
        seconds = prefill(model, cache, ids)
        with DiskTier(save) as other:
            other.put(RecordKey(cache.doc, 0, 0, 4), KVBlock(torch.randn(1, 2, 4, 8),
                                                             torch.randn(1, 2, 4, 8)))
        return seconds

    monkeypatch.setattr(cli_generate, "prefill", raced)
    status, err = run_main(["generate", "--file", "doc.txt", "--question", fact.question,
                            "--save", str(save), *BUDGETS], capsys)
    assert status == 2 and last_line(err) == (f"tierkv: error: --save {save}: exists and is not "
                                              "an empty directory"), err


def test_a_document_past_the_models_context_is_refused_before_prefill(model_and_tok, monkeypatch,
                                                                      capsys, tmp_path):
    """A document longer than SmolLM2's 8192-token context: refused, naming both, before the
    prefill would spend its time on it."""
    from tierkv import cli_generate

    _, tok = model_and_tok
    fact = passkey_fact(random.Random(SEED))
    (tmp_path / "long.txt").write_text(make_document(tok, 8700, SEED, [fact]))
    monkeypatch.setattr(cli_generate, "prefill", lambda *a: pytest.fail("prefilled"))
    status, err = run_main(["generate", "--file", str(tmp_path / "long.txt"), "--question",
                            fact.question, *BUDGETS], capsys)
    assert status == 2, err
    assert re.search(r"--file \S+long.txt: the document is 8\d\d\d tokens and the question \d+, "
                     r"\d+ in all: more than the model's context of 8192 tokens$", last_line(err))


def test_an_answer_that_would_pass_the_models_context_is_capped(saved, monkeypatch, capsys):
    """With room for 2 answer tokens left in the context (made small here: the saved document
    takes a few hundred of SmolLM2's 8192), --max-new-tokens 6 generates 2 and says so."""
    from tierkv import cli_generate

    work, fact, _ = saved
    monkeypatch.chdir(work)
    seen, real_check, real_generate = {}, cli_generate.check_context, None

    def check(model, document, question, source):
        seen["context"] = document + question + 2
        return real_check(model, document, question, source)

    def generate(*args, **kwargs):
        seen["max_new_tokens"] = kwargs["max_new_tokens"]
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(cli_generate, "check_context", check)
    monkeypatch.setattr(cli_generate, "model_context", lambda model: seen["context"])
    real_load = cli_generate._load

    def load(name):
        nonlocal real_generate
        model, tok = real_load(name)
        real_generate = model.generate
        monkeypatch.setattr(model, "generate", generate)
        return model, tok

    monkeypatch.setattr(cli_generate, "_load", load)
    status, err = run_main(["generate", "--load", "saved", "--question", fact.question,
                            "--answer-prefix", fact.answer_prefix, *BUDGETS], capsys)
    assert status == 0, err
    assert seen["max_new_tokens"] == 2
    assert (f"the answer is capped at 2 tokens (--max-new-tokens 6): the document and question "
            f"take {seen['context'] - 2} of the model's {seen['context']}-token context") in err


def test_inspect_into_a_closed_pipe_exits_141_quietly(tmp_path):
    """``tierkv inspect DIR | head`` whose reader went away: status 141, as a shell reports a
    writer killed by SIGPIPE (1 would say the store is not whole), and no noise on stderr."""
    import torch

    from tierkv.storage import KVBlock, RecordKey

    with DiskTier(tmp_path / "store") as tier:
        tier.put(RecordKey("doc0", 0, 0, 4), KVBlock(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)))
    run = subprocess.Popen(command("inspect", tmp_path / "store"), cwd=tmp_path, env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run.stdout.close()  # long before it writes: importing torch takes a while
    err = run.stderr.read()
    assert run.wait(timeout=300) == 141, err
    assert "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_calibrate_keeps_a_profile_of_another_model(model_and_tok, monkeypatch, capsys, tmp_path):
    """A local model directory named like the shipped model does not replace its profile, unless
    --out says where this one goes or --force says to replace it."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from tierkv.hf import calibrate, profile

    _, tok = model_and_tok
    local = tmp_path / "smollm2-135m"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=4, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(local)
    tok.save_pretrained(local)
    shipped = tmp_path / "profiles"
    shutil.copytree(profile.PROFILES, shipped)
    before = (shipped / "smollm2-135m.json").read_text()
    monkeypatch.setattr(profile, "PROFILES", shipped)
    mine = {"model": "smollm2-135m", "filter_layers": [1]}
    monkeypatch.setattr(calibrate, "calibrate", lambda model, tok: mine)
    status, err = run_main(["calibrate", "--model", str(local)], capsys)
    assert status == 2 and last_line(err) == (
        f"tierkv: error: --model {local}: {shipped / 'smollm2-135m.json'} is a profile shipped "
        "for the smollm2-135m model, not this local directory; write this model's elsewhere with "
        "--out DIR, or replace it with --force"), err
    assert (shipped / "smollm2-135m.json").read_text() == before
    assert main(["calibrate", "--model", str(local), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "smollm2-135m.json").read_text()) == mine
    assert main(["calibrate", "--model", str(local), "--force"]) == 0
    assert json.loads((shipped / "smollm2-135m.json").read_text()) == mine


def test_calibrate_of_the_shipped_models_converted_directory_replaces_its_profile(
        model_and_tok, monkeypatch, capsys, tmp_path):
    """The directory tierkv converted the shipped model into is that model: calibrating it
    replaces the shipped profile with no --force (a copy of that directory still needs one)."""
    import json

    from tierkv.hf import calibrate, profile
    from tierkv.hf.model import resolve

    converted = resolve("smollm2-135m")
    shipped = tmp_path / "profiles"
    shutil.copytree(profile.PROFILES, shipped)
    monkeypatch.setattr(profile, "PROFILES", shipped)
    mine = {"model": "smollm2-135m", "filter_layers": [3, 9, 18]}
    monkeypatch.setattr(calibrate, "calibrate", lambda model, tok: mine)
    copy = tmp_path / "copy" / "smollm2-135m"  # its files linked: the weights are 0.5 GB
    copy.mkdir(parents=True)
    for file in converted.iterdir():
        (copy / file.name).symlink_to(file)
    status, err = run_main(["calibrate", "--model", str(copy)], capsys)
    assert status == 2 and "not this local directory" in last_line(err), err
    assert main(["calibrate", "--model", str(converted)]) == 0
    assert json.loads((shipped / "smollm2-135m.json").read_text()) == mine
