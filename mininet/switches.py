"""Starting the emulated switches: the software switch (`luwu switch`) or BMv2 (`simple_switch_grpc`).

Every switch node of the emulation gets one switch process in the root namespace whose ports
are that node's interfaces (AF_PACKET for the software switch, `-i PORT@IFNAME` for BMv2), and
is programmed with the planner's runtime JSON for it: the software switch reads the file at
start, BMv2 gets the pipeline and the entries over P4Runtime (`luwu.daemons.bmv2`, the code
behind `luwu bmv2`, starts and programs it). `--drop P` adds `ingress_drop_sim` entries (the P4
drop simulator) on every port, so it works on both.

The software switch runs as `luwu switch --config FILE` (the daemon's own config format; JSON is
YAML) with `ifaces` for its raw ports and a `stats_file`, whose first write says it is serving.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from luwu.dataplane.process.children import python_module

from .emulation import EmuSwitch
from .processes import Child, ChildError, ChildGroup

SWITCH_KINDS = ("software", "bmv2")
STATS_INTERVAL = 0.5  # s between the software switch's counter dumps
BMV2_CPU_PORT = 255
BMV2_START_TIMEOUT = 30.0  # s for simple_switch_grpc to accept the pipeline


class SwitchError(ChildError):
    """A switch could not be started or programmed; the message says what is missing."""


def drop_entries(ports: list[int], probability: float) -> list[dict]:
    """Runtime entries that make every port lose `probability` of what it receives."""
    if not probability:
        return []
    from luwu.dataplane.p4runtime.entries import drop_rate_entry
    from luwu.dataplane.switch.controls.drop_simulator import threshold_for

    return [drop_rate_entry("ingress", p, threshold=threshold_for(probability)).to_dict() for p in sorted(ports)]


def route_entries(sw: EmuSwitch) -> list[dict]:
    """Runtime `ipv4_lpm` entries for the plain IPv4 the emulation routes through `sw` (rail-only:
    GPU to GPU on one rail, topologies._cross_rail)."""
    from luwu.dataplane.p4runtime.entries import route_entry

    return [route_entry(prefix, plen, port=port, dst_mac=mac).to_dict() for prefix, plen, port, mac in sw.ipv4_routes]


def luwu_command() -> list[str]:
    """The installed `luwu` entry point beside this python, or the module behind it."""
    exe = Path(sys.executable).parent / "luwu"
    return [str(exe)] if exe.exists() else python_module("luwu.cli")


@dataclass
class RunningSwitch:
    spec: EmuSwitch
    child: Child
    stats_file: Path | None = None
    grpc_address: str = ""
    metrics: str = ""  # http://HOST:PORT/metrics of a software switch (Prometheus, docs/observability.md)

    def counters(self) -> dict:
        """{"events": {NAME: [packets, bytes]}, "drops": {...}} as last reported ({} if unknown)."""
        if self.stats_file is not None:
            try:
                raw = json.loads(self.stats_file.read_text())
            except (OSError, json.JSONDecodeError):
                return {}
            return raw.get("counters", raw) if isinstance(raw, dict) else {}
        if self.grpc_address:
            return bmv2_counters(self.grpc_address)
        return {}


def start_software(group: ChildGroup, sw: EmuSwitch, runtime: dict | None, run_dir: Path, seed: int,
                   deadline: float, controller_args: list[str] | None = None) -> RunningSwitch:
    """`luwu switch` on the node's interfaces: loaded from `runtime`, or (runtime None) serving
    P4Runtime on loopback and registering itself with the controller (`controller_args`), which
    then programs it."""
    stats = run_dir / f"{sw.name}.stats.json"
    config = {"lanes": sw.lanes, "slots": sw.slots, "udp_port": sw.udp_port, "seed": seed,
              "service_ip": sw.service_ip, "service_mac": sw.service_mac,
              "ifaces": {str(p): i for p, i in sorted(sw.ports.items())},
              "stats_file": str(stats), "stats_interval": STATS_INTERVAL}
    p4runtime = ""
    if runtime is not None:
        runtime_path = run_dir / f"{sw.name}.runtime.json"
        runtime_path.write_text(json.dumps(runtime, indent=1))
        config["runtime"] = str(runtime_path)
    else:
        p4runtime = config["p4runtime"] = f"127.0.0.1:{_free_tcp_port()}"
    config_path = run_dir / f"{sw.name}.switch.json"
    config_path.write_text(json.dumps(config, indent=1))
    # /metrics on the root namespace's loopback (where the user is); a free port, named in the ready line
    # every P4Runtime write the controller makes, logged by the switch into the run directory
    audit = ["--audit-log", str(run_dir / f"{sw.name}-p4runtime-audit.jsonl")] if p4runtime else []
    child = group.start(f"switch-{sw.name}", luwu_command() + ["switch", "--config", str(config_path),
                                                              "--metrics", "127.0.0.1:0", *audit]
                        + list(controller_args or []))
    ready = child.expect("ready", deadline)
    running = RunningSwitch(sw, child, stats_file=stats, grpc_address=p4runtime,
                            metrics=f"http://{ready['metrics']}/metrics" if ready.get("metrics") else "")
    _wait_file(child, stats, deadline)  # written once the switch serves
    return running


def _wait_file(child: Child, path: Path, deadline: float, poll: float = 0.05) -> None:
    while not path.exists():
        if not child.alive():
            raise ChildError(f"{child.name} exited ({child.proc.returncode}) while starting: {child.tail()}")
        if time.monotonic() > deadline:
            raise ChildError(f"{child.name} did not start serving in time; see {child.log}")
        time.sleep(poll)


# -- BMv2 ------------------------------------------------------------------------------------------

def bmv2_missing() -> str | None:
    """None when BMv2 can run here, else what to install or build."""
    from luwu.daemons.bmv2 import missing

    why = missing()
    return f"--switch bmv2 {why}, or use --switch software" if why else None


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_bmv2(group: ChildGroup, sw: EmuSwitch, runtime: dict | None, run_dir: Path,
               deadline: float) -> RunningSwitch:
    """simple_switch_grpc on the node's interfaces, given the pipeline and `runtime` over P4Runtime
    (runtime None: started bare, for the controller to program)."""
    why = bmv2_missing()
    if why:
        raise SwitchError(why)
    from luwu.daemons import bmv2 as bmv2_switch
    from luwu.p4 import P4INFO_TXTPB

    address = f"127.0.0.1:{_free_tcp_port()}"
    child = group.start(f"switch-{sw.name}", bmv2_switch.command(sw.ports, address, _free_tcp_port(),
                                                                 cpu_port=BMV2_CPU_PORT))
    if runtime is None:
        return RunningSwitch(sw, child, grpc_address=address)
    runtime_path = run_dir / f"{sw.name}.runtime.json"
    runtime_path.write_text(json.dumps(runtime, indent=1))
    try:
        bmv2_switch.program(child.proc, address, runtime_path, Path(P4INFO_TXTPB), bmv2_switch.BMV2_JSON,
                            max(1.0, min(deadline - time.monotonic(), BMV2_START_TIMEOUT)))
    except bmv2_switch.Bmv2Error as e:
        raise SwitchError(f"{sw.name}: {e}: {child.tail()}") from None
    return RunningSwitch(sw, child, grpc_address=address)


def bmv2_counters(address: str) -> dict:
    """The counters of the BMv2 at `address` by name, as the software switch reports them ({} if unreadable)."""
    from luwu.daemons import bmv2 as bmv2_switch
    from luwu.dataplane.protocol import DropReason, Event

    try:
        raw = bmv2_switch.counters(address, timeout=BMV2_START_TIMEOUT)
    except Exception:  # noqa: BLE001 - a switch that cannot be read reports no counters
        return {}

    def name(enum, code):
        try:
            return enum(code).name
        except ValueError:
            return str(code)

    return {"events": {name(Event, c): list(v) for c, v in raw.get("events", {}).items()},
            "drops": {name(DropReason, c): list(v) for c, v in raw.get("drops", {}).items()}}
