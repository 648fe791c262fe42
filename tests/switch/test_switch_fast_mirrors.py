"""Every fast path of the software switch (dataplane/switch/fast/) names the reference it mirrors,
and that reference exists: each module's docstring starts with a `Mirrors:` paragraph naming
`dataplane/switch/<file>.py` `<function>` pairs, each of which is imported here (so renaming or
moving a reference function fails this test until the fast path's docstring follows), and has a
`Declines:` paragraph; fast/__init__.py's table lists exactly the modules of the folder."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAST = REPO / "dataplane" / "switch" / "fast"
MODULES = sorted(p.stem for p in FAST.glob("*.py") if p.stem != "__init__")
REF = re.compile(r"dataplane/switch/([\w/]+)\.py\s+`([\w.]+)`")


def references(doc: str) -> list[tuple[str, str]]:
    """The (module, dotted name) pairs of `doc`'s leading `Mirrors:` paragraph; ValueError when the
    docstring does not start with one or it names no `file.py` `function` pair."""
    if not doc.startswith("Mirrors: "):
        raise ValueError(f"the docstring must start with 'Mirrors: ', it starts with {doc[:40]!r}")
    paragraph = doc.split("\n\n", 1)[0]
    refs = [("luwu.dataplane.switch." + path.replace("/", "."), name) for path, name in REF.findall(paragraph)]
    if not refs:
        raise ValueError("the Mirrors: paragraph names no dataplane/switch/<file>.py `<function>`")
    return refs


def resolve(module: str, name: str) -> object:
    """The object `name` (dotted: `Class.method`) of `module`; ImportError/AttributeError if missing."""
    obj: object = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_folder_holds_the_fast_paths():
    assert MODULES == ["aggregate_groups", "aggregate_one", "aggregate_turn", "classify_few", "emit_shm", "forward_one", "route_few"]


@pytest.mark.parametrize("name", MODULES)
def test_a_fast_path_names_a_reference_that_exists(name):
    doc = ast.get_docstring(ast.parse((FAST / f"{name}.py").read_text()))
    assert doc is not None, f"fast/{name}.py has no docstring"
    refs = references(doc)
    for module, symbol in refs:
        assert ".fast." not in module, f"fast/{name}.py mirrors another fast path ({module}), not a reference"
        assert callable(resolve(module, symbol)), f"fast/{name}.py mirrors {module} {symbol}, which is not callable"
    paragraphs = [p.strip() for p in doc.split("\n\n")]
    assert any(p.startswith("Declines: ") for p in paragraphs[1:3]), \
        f"fast/{name}.py: the paragraph after Mirrors: must start with 'Declines: ' (when it leaves a turn to the reference)"
    importlib.import_module(f"luwu.dataplane.switch.fast.{name}")


def test_the_package_table_lists_every_fast_path():
    doc = ast.get_docstring(ast.parse((FAST / "__init__.py").read_text())) or ""
    listed = re.findall(r"^\| `(\w+)` \|", doc, flags=re.M)
    assert sorted(listed) == MODULES


def test_a_missing_reference_is_caught():
    """The check itself: a docstring naming a function the reference lacks, or no Mirrors: at all, fails."""
    module, symbol = references("Mirrors: dataplane/switch/pipeline.py `Pipeline.no_such_stage`, on ints.")[0]
    assert module == "luwu.dataplane.switch.pipeline"
    with pytest.raises(AttributeError):
        resolve(module, symbol)
    with pytest.raises(ModuleNotFoundError):
        resolve(*references("Mirrors: dataplane/switch/controls/no_such_control.py\n`apply`.")[0])
    with pytest.raises(ValueError):
        references("A fast path.\n\nMirrors: dataplane/switch/pipeline.py `Pipeline.run`.")
    with pytest.raises(ValueError):
        references("Mirrors: the pipeline, roughly.")
