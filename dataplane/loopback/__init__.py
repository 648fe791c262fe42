"""A single-switch (star) deployment on loopback, planned without a controller: the embedded
default of the torch backend with no controller configured, of the benchmarks and of the tests.

- plan.py: `StarPlan`, the ports, sessions and table entries of the star, and the switch it describes;
- launch.py: `LoopbackSwitch`, that switch in a thread or in a child process, and `local_star`;
- daemon.py: the child process (`python -m luwu.dataplane.loopback.daemon`).

The names load on first use (PEP 562): `LoopbackSwitch.prestart`, the first thing the torch
backend's rank 0 does in `init_process_group`, needs launch.py alone, not the plan's table
entries (~10 ms of CPU, docs/backend.md "Start-up").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .launch import LoopbackSwitch, local_star
    from .plan import (
        KERNELS_DEFER,
        SHM_DATA_IN_FLIGHT_BYTES,
        TRANSPORTS,
        StarPlan,
        default_transport,
        free_udp_port,
        plan_from_json,
        plan_to_json,
    )

__all__ = ["KERNELS_DEFER", "SHM_DATA_IN_FLIGHT_BYTES", "TRANSPORTS", "LoopbackSwitch", "StarPlan", "default_transport",
           "free_udp_port", "local_star", "plan_from_json", "plan_to_json"]
_LAUNCH = ("LoopbackSwitch", "local_star")


def __getattr__(name: str):
    if name in _LAUNCH:
        from . import launch

        return getattr(launch, name)
    if name in __all__:
        from . import plan

        return getattr(plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
