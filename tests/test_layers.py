"""The import-linter contracts in pyproject.toml hold, and they catch a wrong-way import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxinfer", "serve", "pallas_kernels", "cpu_kernels")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the packages under `root`, with pyproject.toml's contracts."""
    script = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(script), "--no-cache", str(root / "pyproject.toml")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)


def test_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kept, 0 broken." in result.stdout


def test_a_wrong_way_import_fails(tmp_path):
    """sched (host-only, a low layer) importing the engine breaks two contracts."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    page_pool = tmp_path / "jaxinfer" / "sched" / "page_pool.py"
    page_pool.write_text(page_pool.read_text() + "\nimport jaxinfer.engine  # noqa: E402,F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "jaxinfer.sched.page_pool -> jaxinfer.engine" in result.stdout
    assert "Layers point one way BROKEN" in result.stdout
    assert "Scheduling is host-only: numpy, never JAX BROKEN" in result.stdout
