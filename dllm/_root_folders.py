"""The repository's top-level folders `kernels/`, `samplers/` and `eval/` under their bare names.

They install as `dllm.kernels`, `dllm.samplers` and `dllm.eval`. Python run from the repository root (`python -m
pytest`, `python -m dllm ...`, a script there) puts the root first on `sys.path`, so a bare `import kernels` would
find the folder before an installed distribution of that name: Hugging Face's `kernels`, which transformers
imports from its model classes, is the one that bit. Each folder's `__init__` therefore checks the name it was
imported under and, unless it is its `dllm.` name, hands the bare name to whatever Python would find with the
root left out of the search, or raises the `ModuleNotFoundError` Python would raise there.

Written by hand because no library does it: packaging tools only decide where a folder installs, and a folder
without `__init__.py` (a namespace portion, which never shadows) would lose the packages' public names and does
not survive setuptools' editable install under another name.
"""

from __future__ import annotations

import importlib
import os
import sys

FOLDERS = ("kernels", "samplers", "eval")


def _same_place(entry: str, root: str) -> bool:
    try:
        return os.path.samefile(entry or os.getcwd(), root)
    except OSError:  # a path entry that does not exist (or a zip file's path): not the root
        return False


def hand_over(name: str, init_file: str) -> None:
    """Replace the module being imported as `name` by the one found without the repository root on sys.path.

    Called from the `__init__` of a top-level folder imported under its bare name. Afterwards
    `sys.modules[name]` is the installed distribution, which the import statement then returns; without one
    the import fails as it would from any other directory, saying which `dllm.` name the folder has.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    sys.modules.pop(name, None)  # ours, half made: the import below must not return it
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if not _same_place(entry, root)]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        raise ModuleNotFoundError(
            f"No module named {name!r}: the folder {os.path.join(root, name)} is dllm's own, imported as "
            f"'dllm.{name}', and no other distribution named {name!r} is installed",
            name=name,
        ) from None
    finally:
        sys.path[:] = saved
    sys.modules[name] = module
