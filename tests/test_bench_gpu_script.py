"""bench/gpu.sh, the checks for a lent GPU: on a machine without one it says so and stops."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the script would run its checks")
def test_without_cuda_it_runs_nothing_and_exits_2(tmp_path):
    run = subprocess.run([str(SCRIPT), str(tmp_path / "logs")], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert run.returncode == 2 and "no CUDA device" in run.stderr
    assert not list((tmp_path / "logs").iterdir())


def test_an_interpreter_without_torch_is_named(tmp_path):
    run = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": str(tmp_path / "no-python")}, timeout=60)
    assert run.returncode == 1 and "could not import torch" in run.stderr
