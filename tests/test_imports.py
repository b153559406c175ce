"""The package's import graph: imports flow one way along the data path and close no cycle, and
every module imports first, alone, in a fresh interpreter (cycles once made the order of
imports matter: tests passed only because another module had been imported first)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import mtplx_runtime

PACKAGE = Path(mtplx_runtime.__file__).parent
# ARCHITECTURE.md "Import order": a package may import its own modules and lower ranks only.
# `files` is a module, not a package: file safety under every stage.
RANK = {"files": -1, "formats": 0, "checkpoint": 1, "artifact": 2, "kernels": 3, "offload": 4,
        "model": 5, "engine": 6, "profile": 7, "server": 7, "fixtures": 7, "cli": 8}
MODULES = {"files"}


def import_graph() -> dict[str, set[str]]:
    """{module: package modules it imports}, module-level and function-local imports alike;
    `from pkg import name` counts as importing the submodule when `name` is one."""
    modules: dict[str, tuple[Path, bool]] = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    graph = {}
    for name, (f, is_pkg) in modules.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(u: str, stack: list[str]) -> None:
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else None


def test_every_package_has_a_rank():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(RANK) - MODULES
    assert all((PACKAGE / f"{m}.py").is_file() for m in MODULES)


def test_imports_flow_one_way_along_the_data_path():
    graph = import_graph()
    assert len(graph) > 60 and any(graph.values())
    upward = [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
              if stage(m) and stage(t) and RANK[stage(m)] < RANK[stage(t)]]
    assert not upward, upward


def test_no_import_cycle():
    assert not cycles(import_graph())


def test_the_checks_have_teeth():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    graph = import_graph()
    assert "mtplx_runtime.formats.record" in graph["mtplx_runtime.offload.provider"] or \
        "mtplx_runtime.artifact.open" in graph["mtplx_runtime.offload.provider"]
    assert RANK[stage("mtplx_runtime.offload.provider")] < RANK[stage("mtplx_runtime.engine.plan")]
    assert stage("mtplx_runtime.files") == "files" and "mtplx_runtime.files" in graph[
        "mtplx_runtime.checkpoint.safetensors_io"]


def test_each_module_imports_alone():
    # The lower stages, where the reader/bank cycle once was (the static graph covers the rest).
    names = [m.name for m in pkgutil.walk_packages(mtplx_runtime.__path__, "mtplx_runtime.")
             if m.name.split(".")[1] in ("files", "formats", "checkpoint", "artifact", "offload")]
    assert len(names) > 25
    # One interpreter per module (that is the point), a few at a time on a small machine.
    failed = {}
    for i in range(0, len(names), 8):
        procs = {n: subprocess.Popen([sys.executable, "-c", f"import {n}"],
                                     stderr=subprocess.PIPE, text=True)
                 for n in names[i:i + 8]}
        failed.update({n: p.communicate(timeout=300)[1].strip().splitlines()[-1:]
                       for n, p in procs.items() if p.wait(timeout=300) != 0})
    assert not failed, failed
