"""The README's Python examples run as written: its ```python blocks, in order, as one script,
in a fresh process whose working directory is a temporary one."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return [match.group(1) for match in _BLOCK.finditer(text)]


def test_blocks_are_found():
    text = "intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python\nprint(x)\n```\n"
    assert python_blocks(text) == ["x = 1\n", "print(x)\n"]


def test_readme_python_blocks_run(tmp_path):
    blocks = python_blocks(README.read_text(encoding="utf-8")) if README.is_file() else []
    if not blocks:
        pytest.skip("README.md has no ```python blocks")
    script = tmp_path / "readme_examples.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MPLBACKEND": "Agg"}
    run = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README example failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
