"""The import contract (docs/design.md, "Layers"): the library's packages import one way, and no modules import
each other in a circle. The graph is read from the source with `ast`, function-level (deferred) imports
included, so a circle tied by an import inside a function fails here too.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("prisma_jax", "conversion", "train")

# each layer, with the layers it may import (its own modules always); everything not named is forbidden
MAY_IMPORT = {
    "prisma_jax.core": set(),
    "prisma_jax.nn": {"prisma_jax.core"},
    "prisma_jax.checkpoint": {"prisma_jax.core", "prisma_jax.nn"},
    "prisma_jax.quant": {"prisma_jax.core", "prisma_jax.nn"},
    "prisma_jax.host": {"prisma_jax.core", "prisma_jax.nn"},
    "prisma_jax.parallel": {"prisma_jax.core", "prisma_jax.nn", "prisma_jax.checkpoint"},
    "prisma_jax.infer": {"prisma_jax.core", "prisma_jax.nn", "prisma_jax.checkpoint", "prisma_jax.quant",
                         "prisma_jax.host", "prisma_jax.parallel"},
    "prisma_jax.integrations": {"prisma_jax.core", "prisma_jax.nn", "prisma_jax.checkpoint", "prisma_jax.quant",
                                "prisma_jax.host", "prisma_jax.parallel", "prisma_jax.infer"},
}
MAY_IMPORT["prisma_jax.api"] = MAY_IMPORT["prisma_jax.integrations"] | {"prisma_jax.integrations"}
MAY_IMPORT["prisma_jax"] = MAY_IMPORT["prisma_jax.api"] | {"prisma_jax.api"}     # the package's own __init__
MAY_IMPORT["conversion"] = set(MAY_IMPORT["prisma_jax"]) | {"prisma_jax"}
MAY_IMPORT["train"] = MAY_IMPORT["conversion"] | {"conversion"}
MAY_IMPORT["prisma_jax.apps"] = MAY_IMPORT["train"] | {"train"}


def modules(root: str = ROOT) -> dict[str, str]:
    out = {}
    for top in TOP:
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = os.path.join(d, f)
    return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module → the modules of ours it imports anywhere in its file (relative imports resolved)."""
    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        base = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                parent = ".".join(base[:len(base) - node.level + 1]) if node.level else ""
                target = ".".join(p for p in (parent, node.module) if p)
                found |= {known(f"{target}.{a.name}") for a in node.names}
        graph[mod] = {m for m in found if m and m != mod}
    return graph


def layer(mod: str) -> str:
    """The layer a module belongs to (the longest name in MAY_IMPORT that is it or contains it)."""
    return max((name for name in MAY_IMPORT if mod == name or mod.startswith(name + ".")), key=len)


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            src, dst = layer(mod), layer(dep)
            if src != dst and dst not in MAY_IMPORT[src]:
                bad.append(f"{mod} imports {dep} ({src} may not import {dst})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_belongs_to_a_layer():
    """A new module goes into a layer's package: only `api` and the package's `__init__` sit at the top."""
    assert [m for m in modules() if layer(m) == "prisma_jax" and m != "prisma_jax"] == []


def test_packages_import_one_way():
    assert wrong_way(imports(modules())) == []


def test_no_import_circle():
    assert circles(imports(modules())) == []


def test_the_checks_catch_a_deferred_wrong_way_import_and_a_circle(tmp_path):
    """The same checks on a small tree that breaks both rules, once each, with function-level imports."""
    for rel, text in {"prisma_jax/__init__.py": "", "prisma_jax/nn/__init__.py": "",
                      "prisma_jax/nn/a.py": "def f():\n    from prisma_jax.infer import g\n",
                      "prisma_jax/infer/__init__.py": "", "prisma_jax/infer/g.py": "from . import h\n",
                      "prisma_jax/infer/h.py": "def f():\n    from .g import x\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = imports(modules(str(tmp_path)))
    assert wrong_way(graph) == ["prisma_jax.nn.a imports prisma_jax.infer.g (prisma_jax.nn may not import "
                                "prisma_jax.infer)"]
    assert circles(graph) == [["prisma_jax.infer.g", "prisma_jax.infer.h"]]


@pytest.mark.parametrize("mod", ["prisma_jax.nn.model", "prisma_jax.infer.core", "prisma_jax.checkpoint.orbax"])
def test_library_modules_import_without_the_apps(mod):
    """Nothing below the apps pulls in train/ or conversion/ (what a server or a notebook imports stays small)."""
    graph = imports(modules())
    seen, todo = set(), [mod]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    assert not {m for m in seen if m.split(".")[0] in ("train", "conversion") or m.startswith("prisma_jax.apps")}
