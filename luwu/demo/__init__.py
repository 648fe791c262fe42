"""`luwu demo`: the first command a user runs. On one machine, with no root and no configuration,
it starts a controller, a software switch, an optimizer node and N workers on loopback, trains a
small GPT on the packaged corpus through them, trains the same model with DDP + Gloo + AdamW as
the baseline, and writes report.json and plots (see command.py)."""

from __future__ import annotations


def add_arguments(parser) -> None:
    from .command import add_arguments as add

    add(parser)


def run(args) -> int:
    from .command import run as run_demo

    return run_demo(args)
