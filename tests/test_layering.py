"""The import graph points down the layers and has no cycles between packages.

Every module of the `luwu` import package is parsed (ast, so imports inside functions count
too; the folders are mapped to their import names as pyproject.toml's package-dir does, which
import-graph tools cannot follow). Layers, bottom up (a module may import its own layer or
lower ones):

0. wire facts and leaf helpers: dataplane.protocol, .integrity, .quantize, .usage, .children, .scapy_layer,
   .kernels, .net, .p4runtime (the P4Runtime facts the controller, the software switch and BMv2
   share: P4Info, table entries, credentials), and the generated gRPC stubs in proto;
1. the data plane: dataplane.switch / .engine / .optimizer / .session / .loopback, and p4 (the
   program, its generator and compiler runner);
2. the controller;
3. the worker side: the torch.distributed backend and model-in-network training;
4. applications: the `luwu` package (CLI, daemons, demo, bench, train), mininet, `luwu p4`'s CLI.

A cycle is reported between nodes: each subpackage or module of dataplane, worker and p4
(dataplane.switch, dataplane.protocol, worker.backend, ...), each subpackage or module of the
`luwu` package (luwu.demo, luwu.cli, ...), and the controller, proto and mininet packages whole.

Starting a module as a process is importing it: `children.python_module("luwu.x", ...)` and a
list or tuple literal holding `"-m", "luwu.x"` count as imports of luwu.x, so a data-plane module
that starts an application daemon is an upward arrow. A launch whose module name is not a string
literal (`python_module(name)`, `[..., "-m", name]`) cannot be checked and fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]

LAYERS = {  # longest prefix wins
    "luwu.dataplane.protocol": 0, "luwu.dataplane.quantize": 0, "luwu.dataplane.usage": 0,
    "luwu.dataplane.children": 0, "luwu.dataplane.scapy_layer": 0, "luwu.dataplane.kernels": 0,
    "luwu.dataplane.integrity": 0,
    "luwu.dataplane.trace": 0,
    "luwu.dataplane.net": 0, "luwu.dataplane.p4runtime": 0, "luwu.proto": 0,
    "luwu.dataplane": 1, "luwu.p4": 1,
    "luwu.controller": 2,
    "luwu.worker": 3,
    "luwu": 4, "luwu.mininet": 4, "luwu.p4.tool": 4,
}
NAMES = ["wire", "data plane", "controller", "worker", "application"]


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def modules() -> dict[str, Path]:
    """Import name -> file, from pyproject.toml's package-dir."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}
    for package, folder in cfg["package-dir"].items():
        for f in sorted((REPO / folder).rglob("*.py")):
            parts = list(f.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if any(name == p or name.startswith(p + ".") for p in cfg["package-dir"] if p != package
                   and p.startswith(package + ".")):
                continue  # a folder mapped elsewhere
            if not (f.parent / "__init__.py").exists() and f.parent != REPO / folder:
                continue  # not part of a package (e.g. data folders)
            found[name] = f
    return found


LAUNCHER = "python_module"  # dataplane/children.py: the argv that runs a module
LAUNCHER_MODULE = "luwu.dataplane.children"


def launched(node: ast.AST) -> list[ast.expr]:
    """The module-name expressions a node starts as a process: `python_module(NAME, ...)`'s first
    argument, and in a list/tuple literal the element after a `"-m"` (a bare `"-m"` at its end
    yields the literal itself: a name that cannot be read)."""
    if isinstance(node, ast.Call):
        f = node.func
        if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) == LAUNCHER:
            return [node.args[0] if node.args else node]
    if isinstance(node, (ast.List, ast.Tuple)):
        elts = node.elts
        return [elts[i + 1] if i + 1 < len(elts) else node for i, e in enumerate(elts)
                if isinstance(e, ast.Constant) and e.value == "-m"]
    return []


def imports_in(source: str, name: str, is_package: bool, known: set[str],
               filename: str = "<source>") -> tuple[set[str], list[str]]:
    """(the luwu modules `source` imports or starts anywhere in its body, its unchecked launches).

    Args:
        source: a module's text.
        name: its import name (for relative imports).
        is_package: it is a package's __init__.py.
        known: every module's import name (`from pkg import mod` imports pkg.mod).
        filename: for syntax errors and the unchecked launches' descriptions.
    """
    package = name if is_package else name.rpartition(".")[0]
    out, unchecked = set(), []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
        else:
            targets = []
            for expr in launched(node):
                if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
                    if expr.value.startswith("luwu.") or expr.value == "luwu":
                        targets.append(expr.value)
                    continue  # another program's module (pytest, pip): not ours to check
                if name != LAUNCHER_MODULE:  # the launcher's own body builds the argv from its argument
                    unchecked.append(f"{filename}:{getattr(expr, 'lineno', '?')}: {ast.unparse(expr)[:80]}")
        out.update(t for t in targets if t == "luwu" or t.startswith("luwu."))
    return out, unchecked


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The luwu modules `name` imports (or starts as a process) anywhere in its body."""
    return imports_in(path.read_text(), name, path.name == "__init__.py", known, str(path))[0]


def node(module: str) -> str:
    """The cycle-check node of a module: luwu.dataplane.switch.controls.x -> luwu.dataplane.switch,
    luwu.controller.core -> luwu.controller, luwu.demo.launch -> luwu.demo."""
    parts = module.split(".")
    depth = 3 if parts[1:2] in (["dataplane"], ["worker"], ["p4"]) else 2
    return ".".join(parts[:depth])


def graph():
    mods = modules()
    known = set(mods)
    return {m: imports(m, f, known) for m, f in mods.items()}, known


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import (or launch) that reaches up a layer."""
    found = sorted(f"{m} ({NAMES[layer(m)]}) imports {t} ({NAMES[layer(t)]})"
                   for m, ts in edges.items() for t in ts
                   if t != "luwu" and layer(t) > layer(m))
    # `from luwu import x` in a lower layer reaches into the application package
    found += sorted(f"{m} ({NAMES[layer(m)]}) imports the application package `luwu`"
                    for m, ts in edges.items() if "luwu" in ts and layer(m) < 4)
    return found


def folder(module: str) -> str:
    """The top-level folder of a module (its package-dir entry): luwu.p4.bmv2 -> luwu.p4,
    luwu.cli -> luwu."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[1:2] and parts[1] in FOLDERS else "luwu"


FOLDERS = ("dataplane", "controller", "worker", "proto", "mininet", "p4")


def cycles(edges: dict[str, set[str]], node=node) -> list[str]:
    """Every cycle between the nodes (`node(module)`) of the module graph `edges`."""
    nodes: dict[str, set[str]] = {}
    for m, ts in edges.items():
        a = node(m)
        nodes.setdefault(a, set())
        for t in ts:
            b = node(t)
            if b != a and t != "luwu":  # `from luwu import x` is the upward check's
                nodes[a].add(b)
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(nodes.get(n, ())):
            if state.get(m) == 1:
                found.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(nodes):
        if n not in state:
            visit(n)
    return found


def test_every_import_points_down():
    edges, _ = graph()
    found = upward(edges)
    assert not found, "imports that reach up a layer:\n" + "\n".join(found)


def test_no_cycles_between_packages():
    edges, _ = graph()
    found = cycles(edges)
    assert not found, "package cycles:\n" + "\n".join(found)


def test_no_cycles_between_folders():
    # the folders are the project's parts: one may use another, never the other way round as well
    # (the P4Runtime facts dataplane and p4 both need live in dataplane/p4runtime, not in p4/)
    edges, _ = graph()
    found = cycles(edges, folder)
    assert not found, "folders that import each other:\n" + "\n".join(found)


def test_every_launch_names_its_module():
    # a process started by a computed module name is an import the two tests above cannot see
    mods = modules()
    known = set(mods)
    found = [u for m, f in mods.items()
             for u in imports_in(f.read_text(), m, f.name == "__init__.py", known, str(f.relative_to(REPO)))[1]]
    assert not found, ("launches by a name the layering test cannot read (pass the module as a string "
                       "literal to children.python_module):\n" + "\n".join(found))


def test_the_detector_sees_launches():
    # the checks above must be able to fail on a daemon started by name, not only on an import
    source = (
        "import sys\n"
        "from luwu.dataplane import children\n"
        "def start(args, name):\n"
        "    a = children.die_with_parent([sys.executable, '-m', 'luwu.daemons.engine', *args])\n"
        "    b = children.python_module('luwu.cli', 'node')\n"
        "    c = (sys.executable, '-P', '-m', 'luwu.demo.worker')\n"
        "    d = [sys.executable, '-m', 'pytest']\n"  # another program: not ours, not unchecked
        "    e = python_module(name)\n"
        "    f = [sys.executable, '-m', name]\n"
    )
    found, unchecked = imports_in(source, "luwu.dataplane.engine.client", False, set())
    assert found == {"luwu.dataplane", "luwu.daemons.engine", "luwu.cli", "luwu.demo.worker"}
    assert [u.split(": ", 1)[1] for u in unchecked] == ["name", "name"]
    # ... and the layer check reports such a launch as an arrow up, and a launch loop as a cycle
    assert upward({"luwu.dataplane.engine.client": found}) == [
        f"luwu.dataplane.engine.client (data plane) imports {t} (application)"
        for t in ("luwu.cli", "luwu.daemons.engine", "luwu.demo.worker")]
    loop = {"luwu.dataplane.switch.x": {"luwu.p4.tool"}, "luwu.p4.tool": {"luwu.dataplane.switch.y"}}
    assert cycles(loop) == ["luwu.dataplane.switch -> luwu.p4.tool -> luwu.dataplane.switch"]
    assert cycles({"luwu.dataplane.loopback": {"luwu.p4.entries"}, "luwu.p4.entries": {"luwu.dataplane.protocol"}},
                  folder) == ["luwu.dataplane -> luwu.p4 -> luwu.dataplane"]


def test_the_graph_is_read():
    # the parser must see the project (a broken package-dir reading would pass the tests above)
    edges, known = graph()
    assert {"luwu.dataplane.protocol", "luwu.controller.core", "luwu.worker.backend", "luwu.cli"} <= known
    assert "luwu.dataplane.protocol" in edges["luwu.dataplane.switch.pipeline"] | {
        t for m, ts in edges.items() if m.startswith("luwu.dataplane.switch") for t in ts}
    # the engine daemon is started by name, and the reader sees it
    assert "luwu.dataplane.engine.daemon" in edges["luwu.dataplane.engine.client"]
