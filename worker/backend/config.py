"""Settings of the `luwu` torch.distributed backend, read from the environment with documented defaults.

| variable | default | meaning |
|---|---|---|
| `LUWU_ENGINE` | `embedded` | `embedded`: the SmartNIC engine runs in a thread of the rank; `process`: as its own process beside each rank (`luwu engine`), with one copy of each tensor into a shared buffer and one back (docs/backend.md "Engine: embedded or process") |
| `LUWU_CONTROLLER` | unset | `host:port` of `luwu controller`: the plan comes from its JoinJob (needs `LUWU_JOB`, `LUWU_TOKEN`) |
| `LUWU_JOB` | unset | the controller's job id (controller mode) |
| `LUWU_ENDPOINT_HOST` | `127.0.0.1` | address this rank's engine binds (controller mode; the controller programs the switch with it) |
| `LUWU_PLAN` | unset | a StarPlan JSON file of a switch started separately (its `switch_ports` filled), or this rank's EndpointPlan (`{rank}` in the path) |
| `LOCAL_WORLD_SIZE` | `1` | ranks per server (torchrun sets it): with a rail-only plan, whose sessions each sum one rail, allreduce goes hierarchical over the server's ranks (hierarchy.py) |
| `LUWU_MODE` | `loopback` | packet mode of the embedded switch (`tofino`, `jumbo`, `loopback` or a lane count; `loopback`: 64 KiB datagrams) |
| `LUWU_TRANSPORT` | `shm` (Linux x86-64), else `udp` | ports of the embedded switch: shared-memory rings in /dev/shm, or UDP sockets on loopback (read by `StarPlan`, dataplane/loopback/plan.py) |
| `LUWU_EAGER_START` | unset | `1`: `init_process_group` / `new_group` return only once the group has started (plan, engine, start barrier) and raise its errors; unset: they return at once and the group's first operation waits for its start-up and raises them (docs/backend.md "Start-up") |
| `LUWU_SMALL_BYTES` | `4194304` | collectives of at most this many bytes take the latency path (process_group.py, docs/backend.md "Order and completion": 4 MiB since issue 28's A/B against 256 KiB and 1 MiB, 4 ranks at 1, 4 and 16 MiB); `-1`: none does (for comparisons) |
| `LUWU_CONNECT_TIMEOUT` | `30` | seconds the first collective (a probe at group creation) may take before the switch is declared unreachable |
| `LUWU_P2P_HOST` | `127.0.0.1` | address the point-to-point (send/recv) listener binds and advertises |
| `LUWU_WORKDIR` | a new temp dir | where engine and switch logs go |
| `LUWU_VERIFY_MAX` | `1` | prove every MAX/MIN result from the switch end to end in one more SUM round (max_proof.py); `0`: trust it |
| `LUWU_METRICS` | unset | `HOST:PORT`: serve this rank's engine statistics to Prometheus at PORT + LOCAL_RANK (or + rank) (luwu.worker.metrics) |

Without `LUWU_CONTROLLER` or `LUWU_PLAN` the plan is embedded: rank 0 starts a software switch on
loopback and publishes the plan through the c10d store.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENGINE_MODES = ("process", "embedded")


@dataclass
class BackendConfig:
    engine: str = "embedded"  # less CPU per call than an engine process: docs/backend.md "Engine: embedded or process"
    controller: str = ""
    job: str = ""
    endpoint_host: str = "127.0.0.1"
    plan_file: str = ""
    mode: str = "loopback"
    connect_timeout: float = 30.0
    p2p_host: str = "127.0.0.1"
    workdir: str = ""
    eager_start: bool = False  # LUWU_EAGER_START=1: the torch creator starts the group before returning
    local_world_size: int = 1  # ranks per server (rail-only: the rails); ranks are numbered server by server
    watchdog_tick: float = 0.5  # s between checks of outstanding operations against their deadline
    shutdown_wait: float = 30.0  # s rank 0 keeps the embedded switch up for the other ranks to finish
    log_tail: int = 2000  # characters of an engine/switch log quoted in an error

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BackendConfig:
        if env is None:
            env = os.environ
        cfg = cls(
            engine=env.get("LUWU_ENGINE", cls.engine).strip().lower(),
            controller=env.get("LUWU_CONTROLLER", "").strip(),
            job=env.get("LUWU_JOB", "").strip(),
            endpoint_host=env.get("LUWU_ENDPOINT_HOST", cls.endpoint_host).strip(),
            plan_file=env.get("LUWU_PLAN", "").strip(),
            mode=env.get("LUWU_MODE", cls.mode).strip(),
            p2p_host=env.get("LUWU_P2P_HOST", cls.p2p_host).strip(),
            workdir=env.get("LUWU_WORKDIR", "").strip(),
            eager_start=env.get("LUWU_EAGER_START", "").strip().lower() in ("1", "true", "yes"),
        )
        raw = env.get("LOCAL_WORLD_SIZE", "").strip()
        if raw:
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} must be a positive number of ranks per server")
            cfg.local_world_size = int(raw)
        raw = env.get("LUWU_CONNECT_TIMEOUT", "").strip()
        if raw:
            try:
                cfg.connect_timeout = float(raw)
            except ValueError:
                raise ValueError(f"LUWU_CONNECT_TIMEOUT={raw!r} is not a number of seconds") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.engine not in ENGINE_MODES:
            raise ValueError(f"LUWU_ENGINE={self.engine!r}: choose one of {', '.join(ENGINE_MODES)}")
        if self.connect_timeout <= 0:
            raise ValueError(f"LUWU_CONNECT_TIMEOUT must be a positive number of seconds, got {self.connect_timeout}")
        if self.controller and self.plan_file:
            raise ValueError("set either LUWU_CONTROLLER (plan from the controller) or LUWU_PLAN (a plan file), not both")
        from luwu.dataplane.protocol import lanes_for_mode

        mode = int(self.mode) if self.mode.isdigit() else self.mode
        lanes_for_mode(mode)  # raises with the list of packet modes

    @property
    def packet_mode(self) -> str | int:
        return int(self.mode) if self.mode.isdigit() else self.mode
