"""The optional dependencies (pyproject's extras) and the one message that says how to install a missing one.

The command depends on how dllm was installed: from a clone (`pip install -e .`, the README's quick start) the
extra is installed from that clone's folder; from a registry by the distribution's name.
"""

from __future__ import annotations

import importlib
from pathlib import Path


def install_command(extra: str) -> str:
    """``pip install -e "/path/to/clone[extra]"`` when dllm runs from a clone, else ``pip install "dllm[extra]"``."""
    clone = Path(__file__).resolve().parents[1]
    if (clone / "pyproject.toml").is_file() and (clone / "samplers").is_dir():  # a source tree, not site-packages
        return f'pip install -e "{clone}[{extra}]"'
    return f'pip install "dllm[{extra}]"'


def missing(module: str, extra: str, purpose: str) -> str:
    """One line: what needs ``module``, that it is not installed, and the command that installs ``extra``."""
    return f"{purpose} needs {module}, which is not installed: {install_command(extra)}"


def require(module: str, extra: str, purpose: str):
    """Import ``module``, or raise ImportError whose message says how to install ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if error.name is not None and error.name != module.partition(".")[0] and error.name != module:
            raise  # the module is there but something it imports is broken: that message is the useful one
        raise ImportError(missing(module, extra, purpose), name=module) from None
