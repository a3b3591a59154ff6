"""``python -m tierkv.demo`` (``make demo``): a long document answered with the KV on three tiers.

Three steps, each a separate ``tierkv`` process, as a user would type them:

1. ``tierkv generate --file doc.txt ... --save saved``: prefill a ~3.3K-token document layer by
   layer with a device budget of 10 % of its KV and a host budget of 25 %, so most of the KV goes
   to disk; stream the answer; print tier occupancy and speed; save the prefilled document.
2. ``tierkv inspect saved``: what the saved directory holds, every record verified.
3. ``tierkv generate --load saved ...``: a new process asks a second question without prefilling.

Everything is written under a temporary ``./kv/demo-*`` directory (``kv/`` is git-ignored),
removed at the end.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .textgen import city_fact, make_document, passkey_fact

TOKENS = 3250
SEED = 11
DEVICE_SHARE, HOST_SHARE = 0.10, 0.25
NEW_TOKENS = 10
RULE = "-" * 78
WORK_ROOT = Path("kv")  # on the local disk (a system temp dir may be RAM), and git-ignored
KEY_QUESTION, KEY_PREFIX = "What is the pass key number?", "The pass key number is"

INTRO = f"""\
tierkv demo: one long document, a small model, the KV cache on device, host and disk
{RULE}
SmolLM2-135M, the model shipped for the demo, finds a fact reliably only in documents of about
1-3K tokens. So the demo plants its facts in a generated document of a few thousand tokens and
starts each answer for the model ("The pass key number is"; asked just "the pass key", it
describes a door). The point is not the model's reading but where the KV lives while it
answers, how fast it moves, and that a saved document answers a new question in a new process
without being prefilled again.
"""


def main() -> int:
    """Run the three steps; 0 when every step ran (whatever the model answered)."""
    import torch
    from transformers import AutoTokenizer

    from .hf.model import resolve
    from .shapes import KVShape

    print(INTRO)
    path = resolve("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    rng = random.Random(SEED)
    key, city = passkey_fact(rng), city_fact(rng)
    document = make_document(tok, TOKENS, SEED, [key, city], depths=[0.9, 0.6])
    n_tokens = len(tok(document)["input_ids"])
    kv = KVShape.from_config(_config(path), dtype=torch.float32).kv_bytes(n_tokens)
    device, host = int(kv * DEVICE_SHARE), int(kv * HOST_SHARE)
    print(f"Document: {n_tokens} tokens of generated prose; planted: '{key.sentence}' at 90 % "
          f"depth and '{city.sentence}' at 60 %.")
    print(f"Its KV cache: {kv / 1e6:.0f} MB. Budgets: device {device / 1e6:.1f} MB "
          f"({DEVICE_SHARE:.0%}), host {host / 1e6:.1f} MB ({HOST_SHARE:.0%}); the rest, "
          f"~{(kv - device - host) / 1e6:.0f} MB, goes to disk.\n")
    WORK_ROOT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="demo-", dir=WORK_ROOT) as work:
        work = Path(work)
        (work / "doc.txt").write_text(document, encoding="utf-8")
        return _steps(work, key, city, device, host)


def _config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def _steps(work: Path, key, city, device: int, host: int) -> int:
    budgets = ["--device-budget", f"{device / 1e6:.1f}MB", "--host-budget", f"{host / 1e6:.1f}MB",
               "--max-new-tokens", str(NEW_TOKENS)]
    results = []
    results.append(_step(
        "1/3", "A fresh process prefills the document layer by layer (only one layer's KV on the "
        "device at a time),\n    answers, and saves the prefilled document.",
        ["generate", "--file", "doc.txt", "--question", KEY_QUESTION, "--answer-prefix",
         KEY_PREFIX, "--disk-dir", "disk", "--save", "saved", *budgets], work, key.answer))
    results.append(_step(
        "2/3", "What the saved directory holds; every record is read back and verified.",
        ["inspect", "saved"], work, None))
    results.append(_step(
        "3/3", "A new process asks a second question about the saved document: it reopens it "
        "from disk\n    instead of prefilling it again.",
        ["generate", "--load", "saved", "--question", city.question, "--answer-prefix",
         city.answer_prefix, *budgets], work, city.answer))
    _summary(results)
    return 0 if all(r["rc"] == 0 for r in results) else 1


def _step(number: str, what: str, args: list[str], work: Path, expected: str | None) -> dict:
    """Run one ``tierkv`` command in ``work``, echoing its output as it comes."""
    print(f"{RULE}\n[{number}] {what}\n$ tierkv {' '.join(_quote(a) for a in args)}\n", flush=True)
    t0 = time.perf_counter()
    rc, out = _tee([sys.executable, "-m", "tierkv.cli", *args], work)
    seconds = time.perf_counter() - t0
    found = None if expected is None else expected in out
    if found is not None:
        print(f"\n    -> expected answer {expected!r}: {'found' if found else 'NOT found'}")
    print(f"    -> step {number} took {seconds:.0f} s (exit status {rc})\n", flush=True)
    return {"step": number, "rc": rc, "seconds": seconds, "found": found, "expected": expected}


def _tee(command: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``command``; copy its stdout to ours as it arrives (stderr passes through)."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE)
    chunks = []
    while chunk := os.read(proc.stdout.fileno(), 256):
        chunks.append(chunk)
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
    proc.stdout.close()
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


def _quote(arg: str) -> str:
    return f'"{arg}"' if " " in arg or "?" in arg else arg


def _summary(results: list[dict]) -> None:
    print(f"{RULE}\nSummary")
    for r in results:
        answer = "" if r["found"] is None else \
            f", answer {'correct' if r['found'] else 'wrong'} (expected {r['expected']!r})"
        print(f"  step {r['step']}: {r['seconds']:.0f} s, exit {r['rc']}{answer}")
    first, last = results[0]["seconds"], results[-1]["seconds"]
    print(f"  the saved document answered in {last:.0f} s against {first:.0f} s with its prefill "
          "(both include loading the model)")


if __name__ == "__main__":
    sys.exit(main())
