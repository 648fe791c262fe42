"""The demo's software switch, as its own process: `python -m luwu.demo.switch_host ARGS`.

It binds one UDP port per worker and per optimizer node on loopback, serves P4Runtime, registers
itself with the controller (its ports, which port leads to which node) and reports health until
SIGTERM. The controller then programs its tables over P4Runtime like any switch's. The drop
simulator (`--drop`) is set here, on every port, once the controller has installed the pipeline
(which clears every table); the controller never touches those tables afterwards.
Prints one JSON line `{"ready": true, "p4runtime": ..., "ports": {...}}` when it serves.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from luwu.dataplane.loopback import free_udp_port

HEALTH_INTERVAL = 1.0  # s between health reports to the controller


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="demo-switch")
    p.add_argument("--workers", type=int, required=True, help="worker ports 1..N")
    p.add_argument("--nodes", nargs="+", required=True, help="optimizer node names, on ports N+1...")
    p.add_argument("--lanes", default="jumbo", help="packet mode or lane count")
    p.add_argument("--slots", type=int, default=1024, help="aggregation slots per set")
    p.add_argument("--drop", type=float, default=0.0, help="simulated loss per port and direction")
    p.add_argument("--seed", type=int, default=0, help="drop simulator seed")
    p.add_argument("--controller", required=True, help="controller address HOST:PORT")
    p.add_argument("--token-file", required=True, help="file holding the controller's admin token")


def run(args) -> int:
    from luwu.controller.client import ControllerClient, software_switch_record
    from luwu.controller.config import read_token
    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig
    from luwu.dataplane.switch.p4runtime_server import serve
    from luwu.p4 import P4INFO_TXTPB
    from luwu.proto import controller_pb2 as pb

    sw = SoftwareSwitch(SwitchConfig(lanes=args.lanes, slots=args.slots, seed=args.seed))
    ports = list(range(1, args.workers + len(args.nodes) + 1))
    for port in ports:
        sw.attach_udp(port, ("127.0.0.1", free_udp_port()))
    sw.start()
    p4rt = serve(sw, "127.0.0.1:0", P4INFO_TXTPB, device_id=0)
    client = ControllerClient(args.controller, read_token("", args.token_file))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        nodes = {args.workers + 1 + i: name for i, name in enumerate(args.nodes)}
        reply = client.register_switch(software_switch_record(sw, args.name, p4rt.address, role=pb.STAR, nodes=nodes))
        if args.drop:  # after registration: installing the P4 pipeline (which it does) clears every table
            for port in ports:
                sw.set_drop_sim(port, ingress=args.drop, egress=args.drop)
        beat = client.heartbeat_loop("switch", args.name, HEALTH_INTERVAL)
        print(json.dumps({"ready": True, "name": args.name, "p4runtime": p4rt.address, "registered": reply.message,
                          "ports": {str(p): "%s:%d" % sw.ports[p].address for p in ports}}), flush=True)
        stop.wait()
        beat.stop()
    finally:
        client.close()
        p4rt.stop()
        sw.stop()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m luwu.demo.switch_host")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
