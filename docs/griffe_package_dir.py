"""A Griffe extension for the API reference: make ``dllm.samplers``, ``dllm.kernels`` and ``dllm.eval`` visible.

Those packages live at the top of the repository (``samplers/``, ``kernels/``, ``eval/``) and install inside
the ``dllm`` namespace through ``[tool.setuptools] package-dir`` in ``pyproject.toml``. Griffe's static
analysis walks the ``dllm/`` folder only, so without help ``::: dllm.samplers`` is "not found". When Griffe
has loaded the ``dllm`` package (the ``on_package`` event, which mkdocstrings' collection waits for before it
resolves aliases and looks the object up), this extension visits each mapped folder as a submodule of
``dllm``, so relative imports inside it resolve to ``dllm.samplers.*`` as they do once installed.
The mapping is read from ``pyproject.toml``: nothing is imported or executed.

mkdocs.yml names this file under the mkdocstrings Python handler's ``extensions``; ``exclude_docs`` keeps it
out of the built site.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{"dllm.samplers": <root>/samplers, ...}``: the package-dir entries nested under another package."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {name: root / folder for name, folder in mapping.items() if "." in name}


class PackageDir(griffe.Extension):
    """Load each ``package-dir`` folder as the submodule its installed name says."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for name, folder in package_dirs().items():
            parent_name, _, child = name.rpartition(".")
            if parent_name != pkg.path or child in pkg.members or not (folder / "__init__.py").is_file():
                continue
            # GriffeLoader has no public call that loads a folder under a given parent module; _load_module is
            # what load() itself uses for every submodule (its parent= sets the dotted path).
            module = loader._load_module(child, folder / "__init__.py", submodules=True, parent=pkg)
            pkg.set_member(child, module)
            loader.expand_exports(module)
            loader.expand_wildcards(module, external=False)
