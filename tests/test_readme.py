"""The README's Python example runs as printed, and prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _blocks(section: str) -> tuple[str, str]:
    """The section's python block and the text block after it."""
    readme = (ROOT / "README.md").read_text()
    body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", body, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", body, re.S).group(1)
    return code, shown


def test_the_python_example_prints_what_the_readme_shows(tmp_path):
    code, shown = _blocks("From Python")
    # from another folder: the shipped model is found by its name, not a path relative to the repository
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == shown
