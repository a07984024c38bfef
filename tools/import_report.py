"""How the packages import each other: cycles, imports inside functions, the largest files.

    python tools/import_report.py            # a short report
    python tools/import_report.py --verbose  # every cycle and every import inside a function

The layers themselves are enforced by import-linter (the contracts in pyproject.toml, run by the
test suite); this script shows what the contracts cannot: strongly connected groups of modules
(an import cycle, with or without imports hidden in functions) and where imports were deferred.
An import inside a function is counted apart when it names another package (an optional or heavy
dependency loaded on first use) and when it names one of ours (the kind that hides a cycle).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = ("jaxinfer", "serve", "pallas_kernels", "cpu_kernels")
ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of PACKAGES."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of our modules (a.b.c -> a.b when c is a name)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: resolve against the importing module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{a.name}" for a in node.names]


def scan(root: Path = ROOT):
    """-> (edges {module: {imported modules}}, deferred [(module, line, name, ours)])."""
    modules = module_files(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    deferred = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            targets = {t for n in _imported_names(node, module, is_package)
                       if (t := _resolve(n, modules)) is not None and t != module}
            edges[module] |= targets
            if id(node) in in_function:
                name = node.names[0].name if isinstance(node, ast.Import) else (
                    "." * node.level + (node.module or ""))
                deferred.append((module, node.lineno, name, bool(targets)))
    return edges, deferred


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of two or more modules that import each other, directly or not (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def without_package_inits(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its own modules is not a cycle between ideas: drop the
    edges from a package to the modules inside it."""
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--top", type=int, default=10, help="largest files to list")
    args = parser.parse_args(argv)
    edges, deferred = scan()
    cycles = strongly_connected(without_package_inits(edges))
    ours = [d for d in deferred if d[3]]
    print(f"modules: {len(edges)}, import edges between them: {sum(map(len, edges.values()))}")
    print(f"import cycles (strongly connected groups of modules): {len(cycles)}")
    for group in cycles:
        print("  " + " <-> ".join(group))
    print(f"imports inside functions: {len(deferred)} "
          f"({len(ours)} of our own modules, {len(deferred) - len(ours)} of other packages)")
    for module, line, name, is_ours in deferred:
        if args.verbose or is_ours:
            print(f"  {module}:{line} {name}{'' if is_ours else '  (other package)'}")
    sizes = sorted(((sum(1 for _ in p.open()), str(p.relative_to(ROOT)))
                    for p in module_files(ROOT).values()), reverse=True)
    print("largest files (lines):")
    for n, name in sizes[:args.top]:
        print(f"  {n:5d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
