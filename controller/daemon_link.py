"""How a daemon (`luwu switch`, `luwu node`) joins a controller: command-line options, then a
registration and a heartbeat loop, so the controller's health view comes from the daemon itself.

A daemon that stops (or dies) stops heartbeating, and the controller marks it down and tells
its jobs (docs/architecture.md, controller/README.md).
"""

from __future__ import annotations

import os
import socket

from luwu.dataplane.process.usage import host_port

HEARTBEAT_INTERVAL = 1.0  # s between health reports


def add_controller_arguments(p, kind: str) -> None:
    g = p.add_argument_group("controller (optional)")
    g.add_argument("--controller", default=os.environ.get("LUWU_CONTROLLER"), type=host_port,
                   help=f"register this {kind} with the controller at HOST:PORT and report health "
                        "(default: $LUWU_CONTROLLER)")
    g.add_argument("--token-file", default="", help="file holding the deployment's admin token (else $LUWU_TOKEN)")
    g.add_argument("--name", default=f"{kind}-{socket.gethostname()}-{os.getpid()}",
                   help=f"this {kind}'s name at the controller")


def connect(args):
    """A ControllerClient for `args`, or None when no controller was given."""
    if not getattr(args, "controller", None):
        return None
    from .client import ControllerClient
    from .config import read_token

    return ControllerClient(args.controller, read_token("", args.token_file))
