"""A single-switch (star) deployment on loopback, planned without a controller: the embedded
default of the torch backend with no controller configured, of the benchmarks and of the tests.

- plan.py: `StarPlan`, the ports, sessions and table entries of the star, and the switch it describes;
- launch.py: `LoopbackSwitch`, that switch in a thread or in a child process, and `local_star`;
- daemon.py: the child process (`python -m luwu.dataplane.loopback.daemon`).
"""

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
