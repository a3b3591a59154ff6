"""The ``tierkv`` command: ``generate``, ``inspect``, ``calibrate`` and ``bench``.

Every command checks its inputs before it loads a model. A failure prints one line,
``tierkv: error: ...``, and exits with status 2; ``--debug`` shows the traceback instead. When
the reader of its output goes away (``tierkv inspect DIR | head``), it exits with status 141.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from .config import SelectConfig, parse_size
from .hf.model import ModelLoadError
from .storage.base import CorruptRecordError, StorageError

EXIT_ERROR = 2
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell reports of a writer killed by SIGPIPE
BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
_NOT_BENCHMARKS = {"__init__", "common", "diskbw", "report"}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``tierkv: error: ...`` line (exit 2)."""

    def error(self, message):
        sys.stderr.write(f"tierkv: error: {message} (see '{self.prog} --help')\n")
        sys.exit(EXIT_ERROR)


def size_arg(text: str) -> int:
    """argparse type of a byte size such as ``64MB``."""
    try:
        return parse_size(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("size=", "", 1)) from None


def budget_arg(text: str) -> float | int:
    """argparse type of a token budget: a fraction in (0, 1] written with a point or an
    exponent ("0.1", "1.0": the whole context), or a whole token count ("512")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value > 1 and value.is_integer() or value == 1 and re.fullmatch(r"\s*\+?\d+\s*", text):
        value = int(value)
    try:
        SelectConfig(budget=value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {str(exc).split(': ', 1)[-1]}") from None
    return value


def question_tokens_arg(text: str) -> int:
    """argparse type of ``SelectConfig.question_tokens``: an integer in [0, MAX_QUESTION_TOKENS]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    try:
        SelectConfig(question_tokens=value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("question_tokens=", "", 1)) from None
    return value


def positive_int(text: str) -> int:
    """argparse type of an integer in [1, 100000]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"{value} must be in [1, 100000]")
    return value


def benchmarks() -> list[str]:
    """Names of the benchmarks under ``bench/`` (empty when not run from a source checkout)."""
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in _NOT_BENCHMARKS)


def build_parser() -> argparse.ArgumentParser:
    from .cli_generate import add_generate_args
    from .cli_inspect import add_inspect_args

    parser = _Parser(prog="tierkv", description="Long-context decoding with the KV cache on "
                     "three tiers (device, host, disk).")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    debug = argparse.ArgumentParser(add_help=False)  # --debug after the command name, too
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_generate_args(commands.add_parser(
        "generate", parents=[debug],
        help="answer a question about a long document, streaming the answer"))
    add_inspect_args(commands.add_parser(
        "inspect", parents=[debug],
        help="what a disk directory holds, its health, and a picture of it"))
    calibrate = commands.add_parser("calibrate", parents=[debug], help="write a model's profile "
                                    "(filter layers, retrieval heads)")
    calibrate.add_argument("--model", required=True, help="smollm2-135m or a local model directory")
    calibrate.add_argument("--out", type=Path, help="profile directory (default: the shipped "
                           "profiles of tierkv)")
    calibrate.add_argument("--force", action="store_true", help="replace a profile of the same "
                           "name made for another model (without --out)")
    calibrate.set_defaults(run=run_calibrate)
    bench = commands.add_parser("bench", parents=[debug], help="run a benchmark from bench/ "
                                f"({', '.join(benchmarks()) or 'none found'})")
    bench.add_argument("name", help="benchmark name")
    bench.add_argument("--quick", action="store_true", help="the short version")
    bench.set_defaults(run=run_bench)
    return parser


def run_calibrate(args) -> int:
    """``tierkv calibrate``: calibrate the model and save its profile."""
    from .cli_args import check_creatable
    from .hf.calibrate import calibrate
    from .hf.model import load_model
    from .hf.profile import PROFILES, model_id, save_profile

    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: exists and is not a directory")
    if args.out is not None:
        check_creatable(args.out, "--out")
    model, tok = load_model(args.model)
    if args.out is None and not args.force:
        _check_replaceable_profile(PROFILES / f"{model_id(model)}.json", model, args.model)
    profile = calibrate(model, tok)
    path = save_profile(profile, model_id(model), args.out or PROFILES)
    print(f"profile of {model_id(model)} written to {path}")
    return 0


def _check_replaceable_profile(path: Path, model, name: str) -> None:
    """Refuse to replace the profile at ``path`` when it was made for another model than the one
    ``--model name`` loaded: shipped for the model of that name (``name`` is a local directory
    named like it, not the one tierkv converted the shipped model into), recording another
    model, or not fitting this one."""
    from .hf.model import SHIPPED, shipped_name_of
    from .hf.profile import load_profile, model_id

    if not path.is_file():
        return
    this = model_id(model)
    try:
        recorded = load_profile(model, path.parent).get("model", this)
    except ValueError:
        recorded = None
    if this in SHIPPED and this not in (name, shipped_name_of(name)):
        why = f"shipped for the {this} model, not this local directory"
    elif recorded is None:
        why = "that does not fit this model"
    elif recorded != this:
        why = f"made for the model {recorded!r}"
    else:
        return
    raise ValueError(f"--model {name}: {path} is a profile {why}; write this model's elsewhere "
                     "with --out DIR, or replace it with --force")


def run_bench(args) -> int:
    """``tierkv bench NAME``: run ``python -m bench.NAME`` from the source checkout."""
    names = benchmarks()
    if not names:
        raise ValueError(f"no benchmarks found: {BENCH_DIR} is missing (run from a source checkout)")
    if args.name not in names:
        raise ValueError(f"unknown benchmark {args.name!r}: choose from {', '.join(names)}")
    command = [sys.executable, "-m", f"bench.{args.name}"] + (["--quick"] if args.quick else [])
    return subprocess.run(command, cwd=BENCH_DIR.parent).returncode


def describe(exc: BaseException) -> str:
    """The one-line message of an error the user can act on."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain):
        return f"disk full: {_one_line(exc)} (free space or pick another --disk-dir)"
    if any(isinstance(e, CorruptRecordError) for e in chain):
        return f"corrupt store: {_one_line(exc)} (see 'tierkv inspect DIR')"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tierkv`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # here, so that a reader gone away is caught below
        return status
    except BrokenPipeError:  # the reader of our output went away (``tierkv inspect DIR | head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no noise at exit
        return EXIT_BROKEN_PIPE
    except (ValueError, ModelLoadError, StorageError, OSError, KeyboardInterrupt) as exc:
        if args.debug:
            raise
        sys.stderr.write(f"tierkv: error: {describe(exc)}\n")
        return 130 if isinstance(exc, KeyboardInterrupt) else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
