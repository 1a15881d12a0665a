"""The runner's import rules (runner/__init__.py): each stage imports only the stages below it, and
no stage imports the driver's modules, so the packages read from the bottom up without a cycle."""

from __future__ import annotations

import ast

from tests.conftest import REPO

DRIVER = {"configure", "preflight", "commands", "original_api"}
# stage -> the runner's stages and modules it may import (besides its own package)
ALLOWED = {
    "input": {"timestamps"},
    "storage": {"input", "timestamps"},
    "execution": {"input", "storage", "scoring", "console", "timestamps"},
    "output": {"input", "storage", "console", "timestamps"},
    "console": set(),
    "outcome": set(),
}


def _imported_parts(path) -> set[str]:
    """The runner's top-level stages and modules a file imports, at any depth of its code."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.startswith("runner."):
                parts.add(name.split(".")[1])
            elif name == "runner" and isinstance(node, ast.ImportFrom):
                parts.update(alias.name for alias in node.names)
    return parts


def test_each_stage_imports_only_the_stages_below_it():
    broken = []
    for stage, allowed in ALLOWED.items():
        package = REPO / "runner" / stage
        files = sorted(package.rglob("*.py")) if package.is_dir() else [REPO / "runner" / f"{stage}.py"]
        assert files, stage
        for path in files:
            for part in sorted(_imported_parts(path) - allowed - {stage}):
                broken.append(f"{path.relative_to(REPO)} imports runner.{part}")
    assert not broken, "\n".join(broken)


def test_no_stage_imports_the_driver():
    for path in sorted((REPO / "runner").rglob("*.py")):
        if path.parent == REPO / "runner":
            continue  # the driver's own modules and the shared ones at the top
        assert not _imported_parts(path) & DRIVER, f"{path.relative_to(REPO)} imports the driver"
