"""`luwu switch`: run the software switch as a daemon.

Ports come from `--config` (YAML, see switch.example.yaml) and/or flags; flags win. Prints one
JSON ready line (`{"ready": true, "ports": {N: "HOST:PORT" or "shm:/dev/shm/NAME"}, "p4runtime": ...}`),
rewrites `--stats-file` (JSON counters) every stats interval so a hung job can be diagnosed without a CLI, optionally serves P4Runtime, and shuts down
cleanly on SIGINT/SIGTERM.

P4Runtime is always authenticated (p4runtime_auth.py): by client certificates with a luwu role
(`luwu certs`; mutual TLS with --p4runtime-tls-client-ca), and/or by a bearer token from
--p4runtime-token-file or, with --controller, derived from the admin token and --name (what the
controller sends); with a client CA the token is optional. Without TLS it serves loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from luwu.dataplane.net.shm_ring import supported as shm_supported
from luwu.dataplane.process.usage import UserError, host_port
from luwu.dataplane.session import shm_port_address
from luwu.dataplane.switch.config import (
    DROP_KEYS,
    EXAMPLE,
    SHM_PORT,
    ConfigError,
    DaemonConfig,
    SwitchConfig,
    UdpPortSpec,
    load_daemon_config,
    parse_drop,
    parse_hostport,
    parse_peer,
    switch_port_number,
)
from luwu.dataplane.switch.counters import named
from luwu.dataplane.switch.table_schema import TableError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help=f"YAML config (every option documented in {EXAMPLE})")
    p.add_argument("--runtime", help="p4lang/tutorials runtime JSON to load at start (tables, multicast groups)")
    p.add_argument("--lanes", help="lanes per aggregation packet: a number or a packet mode")
    p.add_argument("--mode", choices=["tofino", "jumbo", "loopback"], help="packet mode (same as --lanes MODE)")
    p.add_argument("--slots", type=int, help="slots per set (default 4096)")
    p.add_argument("--udp-port", type=int, help="UDP port that marks luwu in Ethernet frames (default 19541)")
    p.add_argument("--seed", type=int, help="drop simulator seed (default 0)")
    p.add_argument("--port", action="append", default=[], metavar="N=HOST:PORT[,peer=HOST:PORT|learn]|N=shm",
                   help="UDP attachment of switch port N (repeatable). The port accepts datagrams only from its "
                        "peer: peer=HOST:PORT; without peer=, the endpoint address the controller (or --runtime) "
                        "writes for it, refusing everything until then; peer=learn: the first valid sender "
                        "(opt-in for setups that cannot know the address: whoever sends first owns the port). "
                        "N=shm: a shared-memory port for an endpoint on this host (a ring pair in /dev/shm the "
                        "switch makes, 0600; the ready line and the registration give its address "
                        "shm:/dev/shm/NAME)")
    p.add_argument("--iface", action="append", default=[], metavar="N=IFNAME",
                   help="raw Ethernet attachment of switch port N to an interface (repeatable, root)")
    p.add_argument("--drop", action="append", default=[], metavar="PORT|all:KEY=P[,KEY=P]",
                   help=f"simulated impairments, KEY in {', '.join(DROP_KEYS)}; e.g. all:ingress=0.01 "
                        f"or 3:egress=0.1,reorder=0.05 (repeatable)")
    p.add_argument("--stats-file", help="JSON counters, rewritten every --stats-interval seconds")
    p.add_argument("--metrics", metavar="HOST:PORT", type=host_port,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (docs/observability.md)")
    p.add_argument("--stats-interval", type=float, help="seconds between stats file writes (default 1)")
    p.add_argument("--p4runtime", metavar="ADDR", help="serve P4Runtime on HOST:PORT")
    p.add_argument("--p4info", help="P4Info for --p4runtime (default: the committed p4/build/p4info.txtpb)")
    p.add_argument("--p4runtime-token-file", help="file holding the bearer token that admits a P4Runtime client as "
                                                   "the controller (default with --controller: derived from the "
                                                   "admin token and --name, as the controller does; required "
                                                   "unless --p4runtime-tls-client-ca admits clients by certificate)")
    p.add_argument("--p4runtime-tls-cert", help="PEM certificate: serve P4Runtime over TLS (with --p4runtime-tls-key;"
                                                " needed for a non-loopback --p4runtime address)")
    p.add_argument("--p4runtime-tls-key", help="PEM private key for --p4runtime-tls-cert")
    p.add_argument("--p4runtime-tls-client-ca", help="PEM CA: P4Runtime clients must present a certificate it signed "
                                                     "(mutual TLS); its role (`luwu certs issue NAME --role "
                                                     "controller|reader`) says what the client may do, and the "
                                                     "bearer token becomes optional")
    p.add_argument("--audit-log", metavar="PATH|off",
                   help="with --p4runtime: append every P4Runtime write (who, what, result) to PATH as JSON lines "
                        "(dataplane/p4runtime/audit.py; default $XDG_STATE_HOME/luwu, else "
                        "~/.local/state/luwu, switch-p4runtime-audit.jsonl; off: none)")
    from luwu.controller.daemon_link import add_controller_arguments

    add_controller_arguments(p, "switch")
    p.add_argument("--node-port", action="append", default=[], metavar="N=NODE",
                   help="with --controller: port N leads to optimizer node NODE (repeatable); other ports lead "
                        "to workers unless --peer-port says another switch")
    p.add_argument("--peer-port", action="append", default=[], metavar="N=SWITCH:PORT",
                   help="with --controller: port N is wired to port PORT of switch SWITCH (repeatable)")
    p.add_argument("--port-mac", action="append", default=[], metavar="N=MAC",
                   help="with --controller: the MAC of what is at the other end of raw port N (repeatable); the "
                        "controller plans the frames the switch sends there with it")
    p.add_argument("--route", action="append", default=[], metavar="PREFIX/LEN=PORT[,mac=MAC]",
                   help="with --controller: a static IPv4 route (repeatable), e.g. 10.0.1.2/32=3,mac=02:00:00:00:01:02: "
                        "plain IPv4 to PREFIX/LEN leaves by port PORT with destination MAC MAC (default: the port's "
                        "--port-mac). Declared in the registration; the controller keeps exactly these in ipv4_lpm")
    p.add_argument("--role", choices=["star", "tor", "cluster", "rail"], default="star",
                   help="with --controller: this switch's place in the topology")
    p.add_argument("--rail", type=int, default=0, help="with --role rail: the rail number")


def config_from_args(args) -> DaemonConfig:
    cfg = load_daemon_config(args.config)
    sw = cfg.switch
    overrides = {}
    if args.lanes is not None and args.mode is not None:
        raise ConfigError("give --lanes or --mode, not both")
    if args.lanes is not None or args.mode is not None:
        overrides["lanes"] = args.lanes if args.lanes is not None else args.mode
    for key in ("slots", "udp_port", "seed"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if getattr(args, "metrics", None) or args.stats_file or cfg.stats_file:
        overrides["stragglers"] = True  # someone reads them (/metrics, the stats file, `luwu-ctl top`)
    if overrides:
        fields = {k: getattr(sw, k) for k in sw.__dataclass_fields__}
        fields.update(overrides)
        cfg.switch = SwitchConfig(**fields)
    for spec in args.port:
        num, sep, rest = spec.partition("=")
        if not sep:
            raise ConfigError(f"--port {spec!r}: expected N=HOST:PORT[,peer=HOST:PORT|learn] or N=shm")
        n = switch_port_number(num, f"--port {spec!r}")
        if rest == SHM_PORT:
            cfg.ports.pop(n, None)
            cfg.ifaces.pop(n, None)
            cfg.shm_ports.add(n)
            continue
        if rest.startswith(SHM_PORT + ":"):
            raise ConfigError(f"--port {spec!r}: a shared-memory port is N=shm (the switch names its rings and "
                              f"reports the address); UDP ports are N=HOST:PORT")
        listen, _, peer = rest.partition(",")
        peer_addr = None
        if peer:
            if not peer.startswith("peer="):
                raise ConfigError(f"--port {spec!r}: after the address only peer=HOST:PORT or peer=learn is allowed")
            peer_addr = parse_peer(peer[len("peer="):], f"--port {spec!r} peer")
        cfg.ifaces.pop(n, None)
        cfg.shm_ports.discard(n)
        cfg.ports[n] = UdpPortSpec(parse_hostport(listen, f"--port {spec!r}"), peer_addr)
    for spec in args.iface:
        num, sep, name = spec.partition("=")
        if not sep or not name:
            raise ConfigError(f"--iface {spec!r}: expected N=IFNAME")
        n = switch_port_number(num, f"--iface {spec!r}")
        cfg.ports.pop(n, None)
        cfg.shm_ports.discard(n)
        cfg.ifaces[n] = name
    for spec in args.drop:
        where, sep, body = spec.partition(":")
        if not sep:
            raise ConfigError(f"--drop {spec!r}: expected PORT|all:KEY=P[,KEY=P], e.g. all:ingress=0.01")
        key = "all" if where == "all" else str(switch_port_number(where, f"--drop {spec!r}"))
        values = {}
        for item in body.split(","):
            k, eq, v = item.partition("=")
            try:
                values[k.strip()] = float(v)
            except ValueError:
                raise ConfigError(f"--drop {spec!r}: {item!r} must be KEY=PROBABILITY") from None
            if not eq:
                raise ConfigError(f"--drop {spec!r}: {item!r} must be KEY=PROBABILITY")
        cfg.drop.setdefault(key, {}).update(parse_drop(values, f"--drop {spec!r}"))
    for key in ("runtime", "stats_file", "p4runtime", "p4info"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    if args.stats_interval is not None:
        if not 0.05 <= args.stats_interval <= 3600:
            raise ConfigError(f"--stats-interval {args.stats_interval} must be seconds in [0.05, 3600]")
        cfg.stats_interval = args.stats_interval
    if not cfg.ports and not cfg.ifaces and not cfg.shm_ports:
        raise ConfigError("no switch ports: give --port N=HOST:PORT, --port N=shm or --iface N=IFNAME (or "
                          "ports:/ifaces: in --config)")
    return cfg


def _show(addr) -> str | None:
    if addr is None:
        return None
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


def _port_address(attachment) -> str | None:
    """A port's address as endpoints and the controller take it: HOST:PORT, shm:/dev/shm/NAME, or the interface."""
    if getattr(attachment, "kind", "") == "shm":
        return shm_port_address(attachment.address)
    return _show(attachment.address)


def write_stats(sw, path: str, started: float) -> None:
    with sw.lock:
        sw.sync_peers()  # the peers the tables name now, even before a packet came
    snap = sw.counters()
    doc = {"time": time.time(), "uptime_s": round(time.monotonic() - started, 3), "lanes": sw.lanes,
           "slots": sw.config.slots, "errors": sw.errors,
           "ports": {str(p): {"address": _port_address(a), "peer": _show(a.peer)} for p, a in sorted(sw.ports.items())},
           "counters": named(snap)}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)  # readers never see a half-written file


def _start_p4runtime(sw, cfg: DaemonConfig, args):
    try:
        from luwu.dataplane.switch import p4runtime_server
    except ImportError as e:
        raise ConfigError(f"--p4runtime needs luwu.dataplane.switch.p4runtime_server, which cannot be imported "
                          f"({e}); run without --p4runtime or install the controller part") from None
    p4info = cfg.p4info
    if p4info is None:
        try:
            from luwu.p4 import P4INFO_TXTPB as p4info
        except ImportError:
            p4info = None
    credentials, auth = _p4runtime_tls(args), _p4runtime_auth(args)
    audit = _audit_log(args)
    try:
        return p4runtime_server.serve(sw, cfg.p4runtime, p4info, device_id=0, credentials=credentials, auth=auth,
                                      audit=audit, client_ca=bool(args.p4runtime_tls_client_ca))
    except ValueError as e:  # a token in clear text beyond loopback
        raise ConfigError(str(e)) from None


def _audit_log(args):
    """--audit-log's AuditLog (None with `off`)."""
    from luwu.dataplane.p4runtime.audit import AuditLog, default_audit_path

    if args.audit_log == "off":
        return None
    path = args.audit_log or default_audit_path("switch")
    try:
        return AuditLog(path, {"switch": getattr(args, "name", "") or "", "pid": os.getpid()})
    except OSError as e:
        raise ConfigError(f"--audit-log: {e}") from None


def _p4runtime_auth(args):
    """Who P4Runtime admits: certificate roles with a client CA, and/or the token (ConfigError saying
    where to get a credential when there is none)."""
    from luwu.controller.config import read_token
    from luwu.dataplane.p4runtime import switch_token
    from luwu.dataplane.switch.p4runtime_auth import P4RuntimeAuth

    certificates = bool(args.p4runtime_tls_client_ca)
    if args.p4runtime_token_file:
        token = read_token("", args.p4runtime_token_file)
        if not token:
            raise ConfigError(f"--p4runtime-token-file {args.p4runtime_token_file} is empty: write the token into it")
        return P4RuntimeAuth(token, certificates=certificates)
    if getattr(args, "controller", None):
        admin = read_token("", args.token_file)
        if admin:
            return P4RuntimeAuth(switch_token(admin, args.name), certificates=certificates)
    if certificates:
        return P4RuntimeAuth(None, certificates=True)
    raise ConfigError("--p4runtime needs a credential for its clients: pass --p4runtime-tls-client-ca CA (client "
                      "certificates of `luwu certs issue --role`), --p4runtime-token-file FILE, or --controller "
                      "with --token-file (the controller's token is then derived)")


def _p4runtime_tls(args):
    cert, key, ca = args.p4runtime_tls_cert, args.p4runtime_tls_key, args.p4runtime_tls_client_ca
    if bool(cert) != bool(key):
        raise ConfigError("P4Runtime TLS needs both --p4runtime-tls-cert and --p4runtime-tls-key")
    if ca and not cert:
        raise ConfigError("--p4runtime-tls-client-ca needs --p4runtime-tls-cert/--p4runtime-tls-key")
    if not cert:
        return None
    from luwu.dataplane.switch.p4runtime_auth import server_credentials

    for flag, path in (("--p4runtime-tls-cert", cert), ("--p4runtime-tls-key", key), ("--p4runtime-tls-client-ca", ca)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    return server_credentials(cert, key, ca or "")


def _join_controller(args, sw, p4rt, metrics: str | None = None):
    """Register with the controller (which then installs the pipeline and programs the tables over
    P4Runtime; `metrics`, the /metrics address, is where it scrapes `luwu-ctl top`'s counters) and
    report health with the switch's counters; None without --controller."""
    from luwu.controller.daemon_link import HEARTBEAT_INTERVAL, connect

    client = connect(args)
    if client is None:
        return None
    from luwu.controller.client import software_switch_record
    from luwu.proto import controller_pb2 as pb

    nodes, peers = {}, {}
    for spec in args.node_port:
        num, _, name = spec.partition("=")
        nodes[switch_port_number(num, f"--node-port {spec!r}")] = name
    for spec in args.peer_port:
        num, _, rest = spec.partition("=")
        other, _, port = rest.rpartition(":")
        if not other or not port.isdigit():
            raise ConfigError(f"--peer-port {spec!r}: expected N=SWITCH:PORT")
        peers[switch_port_number(num, f"--peer-port {spec!r}")] = (other, int(port))
    macs = {}
    for spec in args.port_mac:
        num, _, mac = spec.partition("=")
        if len(mac.split(":")) != 6:
            raise ConfigError(f"--port-mac {spec!r}: expected N=aa:bb:cc:dd:ee:ff")
        macs[switch_port_number(num, f"--port-mac {spec!r}")] = mac
    role = {"star": pb.STAR, "tor": pb.TOR, "cluster": pb.CLUSTER, "rail": pb.RAIL}[args.role]
    record = software_switch_record(sw, args.name, p4rt.address, role=role, rail=args.rail,
                                     peers=peers, nodes=nodes, macs=macs)
    record.routes.extend(parse_route(spec) for spec in args.route)  # the controller checks ports, prefixes, MACs
    record.metrics_address = metrics or ""  # where the controller scrapes what `luwu-ctl top` shows
    client.register_switch(record)

    def counters() -> dict[str, int]:
        snap = named(sw.counters())
        return {f"{kind}.{label}": int(v[0]) for kind, table in snap.items() if isinstance(table, dict)
                for label, v in table.items() if isinstance(v, (list, tuple)) and v and v[0]}

    return client.heartbeat_loop("switch", args.name, HEARTBEAT_INTERVAL, counters=counters)


def parse_route(spec: str):
    """`--route PREFIX/LEN=PORT[,mac=MAC]` as the registration's Ipv4Route (the form only: the
    controller checks the prefix, that the port is the switch's and the MAC)."""
    from luwu.proto import controller_pb2 as pb

    prefix, sep, rest = spec.partition("=")
    port, _, extra = rest.partition(",")
    if not sep or "/" not in prefix or not port:
        raise ConfigError(f"--route {spec!r}: expected PREFIX/LEN=PORT[,mac=MAC], e.g. 10.0.1.2/32=3")
    mac = ""
    if extra:
        if not extra.startswith("mac="):
            raise ConfigError(f"--route {spec!r}: after the port only mac=aa:bb:cc:dd:ee:ff is allowed")
        mac = extra[len("mac="):]
    return pb.Ipv4Route(prefix=prefix, port=switch_port_number(port, f"--route {spec!r}"), mac=mac)


def _apply_drop(sw, cfg: DaemonConfig) -> None:
    for n in sorted(set(cfg.ports) | set(cfg.ifaces) | cfg.shm_ports):
        probs = cfg.drop_for(n)
        if any(probs.values()):
            sw.set_drop_sim(n, **probs)


def run(args) -> int:
    from luwu.dataplane.observe import trace
    from luwu.dataplane.process.heap import freeze_collector, retain_freed_memory
    from luwu.dataplane.switch.switch import SoftwareSwitch

    trace.start("switch")
    retain_freed_memory()  # the event loop's batch temporaries stay mapped (dataplane/process/heap.py)
    freeze_collector()  # start-up objects leave the collector's sight (again once the kernels load)

    stop = threading.Event()
    p4rt = None
    sw = None
    beat = None
    metrics = None
    try:
        cfg = config_from_args(args)
        if getattr(args, "route", None) and not args.controller:
            raise ConfigError("--route is declared to the controller: add --controller (without one, put ipv4_lpm "
                              "entries in --runtime)")
        for spec in getattr(args, "route", []):  # the form, before any port or connection is opened
            parse_route(spec)
        sw = SoftwareSwitch(cfg.switch)
        for n, spec in sorted(cfg.ports.items()):
            try:
                sw.attach_udp(n, spec.listen, spec.peer)
            except OSError as e:
                raise ConfigError(f"switch port {n}: cannot bind UDP {spec.listen[0]}:{spec.listen[1]}: "
                                  f"{e.strerror}") from None
        if cfg.shm_ports and not shm_supported():
            raise ConfigError("shared-memory ports (--port N=shm) need Linux on x86-64 with /dev/shm: use --port "
                              "N=HOST:PORT here")
        for n in sorted(cfg.shm_ports):
            sw.attach_shm(n)  # ConfigError naming the port when its rings cannot be made
        for n, name in sorted(cfg.ifaces.items()):
            sw.attach_raw(n, name)
        if cfg.runtime:
            sw.load_runtime(cfg.runtime)
        if args.controller and not cfg.p4runtime:
            raise ConfigError("--controller needs --p4runtime ADDR: the controller programs the switch over it")
        if cfg.p4runtime:
            p4rt = _start_p4runtime(sw, cfg, args)
        # before registration, so that the record declares the simulated loss (the controller keeps it and
        # removes any other drop_sim entry), and again after: the controller's pipeline install clears the tables
        _apply_drop(sw, cfg)
        if getattr(args, "metrics", None):  # before registering: the registration says where it is
            from luwu.dataplane.observe.metrics import SwitchCollector, serve

            try:
                metrics = "{}:{}".format(*serve(args.metrics, SwitchCollector(sw.counters)))
            except OSError as e:
                raise ConfigError(f"--metrics {args.metrics}: cannot serve there: {e.strerror}") from None
        beat = _join_controller(args, sw, p4rt, metrics)
        if beat is not None:
            _apply_drop(sw, cfg)
    except (ConfigError, TableError, FileNotFoundError, ConnectionError, RuntimeError, UserError) as e:
        print(f"luwu switch: {e}", file=sys.stderr)
        if sw is not None:
            sw.stop()
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    sw.start()
    # one JSON line, like every luwu daemon's ready line
    print(json.dumps({"ready": True, "lanes": sw.lanes, "slots": sw.config.slots, "udp_port": sw.config.udp_port,
                      "ports": {str(p): _port_address(a) for p, a in sorted(sw.ports.items())},
                      "p4runtime": getattr(p4rt, "address", cfg.p4runtime) if p4rt is not None else None,
                      "metrics": metrics,
                      "audit_log": str(p4rt.servicer.audit.path) if p4rt is not None and p4rt.servicer.audit else None,
                      "name": getattr(args, "name", None) if beat is not None else None}), flush=True)
    try:
        while not stop.is_set():
            if cfg.stats_file:
                try:
                    write_stats(sw, cfg.stats_file, started)
                except OSError as e:
                    print(f"luwu switch: cannot write stats file {cfg.stats_file}: {e.strerror}", file=sys.stderr)
            stop.wait(cfg.stats_interval)
    finally:
        if beat is not None:
            beat.stop()
        if p4rt is not None:
            p4rt.stop()
        if cfg.stats_file:
            try:
                write_stats(sw, cfg.stats_file, started)
            except OSError:
                pass
        sw.stop()
        print("luwu switch stopped", flush=True)
    return 0

