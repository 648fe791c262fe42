"""The import graph points down the layers and has no cycles between packages.

Every module of the `luwu` import package is parsed (ast, so imports inside functions count
too; the folders are mapped to their import names as pyproject.toml's package-dir does, which
import-graph tools cannot follow). Layers, bottom up (a module may import its own layer or
lower ones):

0. wire facts and leaf helpers: dataplane.protocol, .quantize, .usage, .children, .scapy_layer,
   .kernels, .net, and the generated gRPC stubs in proto;
1. the data plane: dataplane.switch / .engine / .optimizer / .session / .loopback, and p4 (the
   program, its generator and compiler runner);
2. the controller;
3. the worker side: the torch.distributed backend and model-in-network training;
4. applications: the `luwu` package (CLI, daemons, demo, bench, train), mininet, `luwu p4`'s CLI.

A cycle is reported between nodes: each subpackage or module of dataplane, worker and p4
(dataplane.switch, dataplane.protocol, worker.backend, ...), each subpackage or module of the
`luwu` package (luwu.demo, luwu.cli, ...), and the controller, proto and mininet packages whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]

LAYERS = {  # longest prefix wins
    "luwu.dataplane.protocol": 0, "luwu.dataplane.quantize": 0, "luwu.dataplane.usage": 0,
    "luwu.dataplane.children": 0, "luwu.dataplane.scapy_layer": 0, "luwu.dataplane.kernels": 0,
    "luwu.dataplane.trace": 0,
    "luwu.dataplane.net": 0, "luwu.proto": 0,
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


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The luwu modules `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
            continue
        out.update(t for t in targets if t == "luwu" or t.startswith("luwu."))
    return out


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


def test_every_import_points_down():
    edges, _ = graph()
    upward = sorted(f"{m} ({NAMES[layer(m)]}) imports {t} ({NAMES[layer(t)]})"
                    for m, ts in edges.items() for t in ts
                    if t != "luwu" and layer(t) > layer(m))
    # `from luwu import x` in a lower layer reaches into the application package
    upward += sorted(f"{m} ({NAMES[layer(m)]}) imports the application package `luwu`"
                     for m, ts in edges.items() if "luwu" in ts and layer(m) < 4)
    assert not upward, "imports that reach up a layer:\n" + "\n".join(upward)


def test_no_cycles_between_packages():
    edges, _ = graph()
    nodes: dict[str, set[str]] = {}
    for m, ts in edges.items():
        a = node(m)
        nodes.setdefault(a, set())
        for t in ts:
            b = node(t)
            if b != a and t != "luwu":
                nodes[a].add(b)
    cycles, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(nodes.get(n, ())):
            if state.get(m) == 1:
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(nodes):
        if n not in state:
            visit(n)
    assert not cycles, "package cycles:\n" + "\n".join(cycles)


def test_the_graph_is_read():
    # the parser must see the project (a broken package-dir reading would pass the tests above)
    edges, known = graph()
    assert {"luwu.dataplane.protocol", "luwu.controller.core", "luwu.worker.backend", "luwu.cli"} <= known
    assert "luwu.dataplane.protocol" in edges["luwu.dataplane.switch.pipeline"] | {
        t for m, ts in edges.items() if m.startswith("luwu.dataplane.switch") for t in ts}
