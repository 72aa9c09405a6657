"""The floors of ARCHITECTURE.md hold: every import in the package points down or sideways, never up.

Read from the source (every ``import``, at module level or inside a function), so that a lazy import cannot
hide an upward edge. Floors, lowest first: the ground (protocols, statistics, numerics, stops, defaults,
counting, syncs, models, data, kernels, the guard that keeps the top-level folders from answering their bare names,
the message for a missing extra), the samplers, and the front door (``generate``, ``load``, the CLI, evaluation and
speed studies, training, which evaluates through ``generate``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's source lives (pyproject's package-dir).
FOLDERS = {"dllm": ROOT / "dllm", "dllm.samplers": ROOT / "samplers", "dllm.kernels": ROOT / "kernels",
           "dllm.eval": ROOT / "eval"}
GROUND = ("dllm.protocols", "dllm.stats", "dllm.numerics", "dllm.stops", "dllm.defaults", "dllm.counting",
          "dllm.syncs", "dllm.models", "dllm.data", "dllm.kernels", "dllm._root_folders", "dllm.extras")
MIDDLE = ("dllm.samplers",)


def floor(module: str) -> int:
    """0 ground, 1 samplers, 2 front door (anything else of the package)."""
    if any(module == name or module.startswith(name + ".") for name in GROUND):
        return 0
    if any(module == name or module.startswith(name + ".") for name in MIDDLE):
        return 1
    return 2


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "dllm" and parts and parts[0] in ("samplers", "kernels", "eval"):
                continue  # no such folders under dllm/; guard anyway
            found[".".join((package, *parts))] = path
    return found


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports (``from dllm import stops`` names the module dllm.stops)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {edge for edge in edges if edge == "dllm" or edge.startswith("dllm.")}


def test_no_import_points_up_a_floor():
    found = modules()
    upward = []
    for module, path in sorted(found.items()):
        for target in sorted(imports(module, path, set(found))):
            if floor(target) > floor(module):
                upward.append(f"{module} imports {target}")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule fails where it should: a ground-floor module importing a sampler or the front door."""
    path = tmp_path / "probe.py"
    path.write_text("from dllm.samplers import SAMPLERS\n\ndef f():\n    import dllm.api\n")
    edges = imports("dllm.models.probe", path, {"dllm.samplers", "dllm.api"})
    assert edges == {"dllm.samplers", "dllm.api"}
    assert all(floor(edge) > floor("dllm.models.probe") for edge in edges)
    relative = tmp_path / "rel.py"
    relative.write_text("from ..sessions import Caller\nfrom . import canvas\n")
    assert imports("dllm.samplers.fef.rel", relative, {"dllm.samplers.fef.canvas"}) == {
        "dllm.samplers.sessions", "dllm.samplers.fef.canvas"}
