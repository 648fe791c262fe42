"""luwu demo's CPU report (luwu/demo/cpu.py) finds each process's role by its command line: the
engine daemons' must match the module name the engine client really starts them by."""

from __future__ import annotations

import os

from luwu.dataplane.process import children
from luwu.demo.cpu import ROLES


def role(argv: list[str]) -> str:
    line = " ".join(argv)
    return next((r for r, needle in ROLES if needle in f" {line} "), "other")


def test_each_child_command_line_gets_its_role():
    # after die_with_parent's exec the command line is python_module's argv
    engine = children.python_module("luwu.dataplane.engine.daemon", "--control", "/tmp/x.sock", "--batch", "64")
    assert role(engine) == "engines"
    assert role(children.python_module("luwu.demo.worker", "spec.json", "0")) == "workers"
    assert role(children.python_module("luwu.cli", "switch", "--port", "1=127.0.0.1:0")) == "switch"
    assert role(children.python_module("luwu.cli", "node", "--plan", "p.json")) == "optimizer nodes"
    assert role([os.devnull, "something", "else"]) == "other"
