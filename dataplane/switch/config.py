"""Configuration of the software switch: `SwitchConfig` (the pipeline and its event loop) and
`DaemonConfig` (what `luwu switch` reads from YAML and flags: ports, runtime, stats, P4Runtime).

Every option has a documented default here and in `switch.example.yaml`; bad values raise
`ConfigError` with the key and what is allowed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..protocol import DEFAULT_UDP_PORT, MAX_UDP_PAYLOAD, aggregation_packet_len, lanes_for_mode
from .table_schema import PORT_BITS

EXAMPLE = Path(__file__).with_name("switch.example.yaml")  # every option, documented


class ConfigError(ValueError):
    """A switch configuration value that cannot work, with the key and what to fix."""


@dataclass
class SwitchConfig:
    lanes: int | str = "jumbo"  # packet mode name (tofino 64, jumbo 2048, loopback 16000) or a lane count
    slots: int = 4096  # slots per set (registers hold 2 * slots)
    udp_port: int = DEFAULT_UDP_PORT  # UDP destination port that marks luwu packets in Ethernet frames
    seed: int = 0  # seeds the drop simulator's random streams (reproducible loss)
    batch: int = 64  # datagrams per recvmmsg/sendmmsg call
    max_datagram: int = 65536  # receive buffer per datagram on UDP ports (>= the largest luwu packet)
    max_frame: int = 16384  # receive buffer per frame on raw ports (>= MTU + 14)
    poll_interval: float = 0.02  # s the event loop sleeps in poll() when every port is idle
    reorder_hold: float = 0.005  # s a packet held back by the reorder simulator waits for a successor
    socket_buffer: int = 8 << 20  # bytes asked for SO_RCVBUF/SO_SNDBUF of every port socket
    max_register_bytes: int = 4 << 30  # refuse slot/lane combinations whose lane registers exceed this
    service_ip: str = "10.255.255.254"  # source IPv4 of frames synthesised for packets that came in over UDP
    service_mac: str = "02:00:00:00:00:fe"  # source MAC of those frames
    # record last arrivals per worker (stragglers.py): ~20 us per batch, so off unless someone reads
    # them (`luwu switch` turns it on with --metrics or --stats-file)
    stragglers: bool = False

    def __post_init__(self):
        try:
            self.lanes = lanes_for_mode(self.lanes)
        except ValueError as e:
            raise ConfigError(f"lanes: {e}") from None
        _int_range("slots", self.slots, 1, 1 << 24)
        _int_range("udp_port", self.udp_port, 1, 65535)
        _int_range("batch", self.batch, 1, 1024)
        _int_range("seed", self.seed, 0, 2**63 - 1)
        need = aggregation_packet_len(self.lanes)
        if not need <= self.max_datagram <= MAX_UDP_PAYLOAD + 29:
            raise ConfigError(f"max_datagram {self.max_datagram} must be {need}..{MAX_UDP_PAYLOAD + 29} "
                              f"(a {self.lanes}-lane packet is {need} bytes)")
        _int_range("max_frame", self.max_frame, 64, 65536 + 14)
        for name in ("poll_interval", "reorder_hold"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 10:
                raise ConfigError(f"{name} {v!r} must be a number of seconds in (0, 10]")
        _int_range("socket_buffer", self.socket_buffer, 4096, 1 << 30)
        reg = 2 * self.slots * self.lanes * 4
        if reg > self.max_register_bytes:
            raise ConfigError(f"lane registers need 2 x {self.slots} slots x {self.lanes} lanes x 4 B = "
                              f"{reg / 2**20:.0f} MiB, above max_register_bytes ({self.max_register_bytes / 2**20:.0f} "
                              f"MiB): lower slots or lanes, or raise max_register_bytes")
        try:
            ipaddress.IPv4Address(self.service_ip)
        except ValueError:
            raise ConfigError(f"service_ip {self.service_ip!r} is not an IPv4 address") from None
        if len(self.service_mac.split(":")) != 6:
            raise ConfigError(f"service_mac {self.service_mac!r} must look like 02:00:00:00:00:fe")


def _int_range(name: str, v, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{name} {v!r} must be an integer in {lo}..{hi}")


# --- the daemon -------------------------------------------------------------------------------

DROP_KEYS = ("ingress", "egress", "duplicate", "reorder")
SHM_PORT = "shm"  # a port spec (`--port N=shm`, `ports: {N: shm}`): shared-memory rings the switch makes


@dataclass
class UdpPortSpec:
    listen: tuple[str, int]
    # (host, port); None: the address the tables (controller) give the port, refused until then;
    # "learn": the first valid sender's (opt-in, attach_udp.py)
    peer: tuple[str, int] | str | None = None


@dataclass
class DaemonConfig:
    switch: SwitchConfig = field(default_factory=SwitchConfig)
    ports: dict[int, UdpPortSpec] = field(default_factory=dict)  # UDP attachments
    shm_ports: set[int] = field(default_factory=set)  # shared-memory attachments (ring pairs the switch makes)
    ifaces: dict[int, str] = field(default_factory=dict)  # raw (AF_PACKET) attachments
    drop: dict[str, dict[str, float]] = field(default_factory=dict)  # "all" or a port -> probabilities
    runtime: str | None = None  # p4lang/tutorials runtime JSON to load at start
    stats_file: str | None = None  # JSON counters, rewritten every stats_interval
    stats_interval: float = 1.0
    p4runtime: str | None = None  # serve P4Runtime on this address
    p4info: str | None = None  # P4Info the P4Runtime server checks pipelines against (default: the committed one)

    def drop_for(self, port: int) -> dict[str, float]:
        merged = dict(self.drop.get("all", {}))
        merged.update(self.drop.get(str(port), {}))
        return merged


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what}: {text!r} must be HOST:PORT, e.g. 127.0.0.1:9001")
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"{what}: port {port!r} in {text!r} is not a number") from None
    if not 0 <= p <= 65535:
        raise ConfigError(f"{what}: port {p} in {text!r} out of range 0..65535")
    return host, p


def parse_peer(text: str, what: str) -> tuple[str, int] | str:
    """A UDP port's peer: HOST:PORT, or `learn` (the first valid sender becomes the peer)."""
    if str(text).strip() == "learn":
        return "learn"
    if ":" not in str(text):
        raise ConfigError(f"{what}: {text!r} must be HOST:PORT or learn")
    return parse_hostport(text, what)


def switch_port_number(text, what: str) -> int:
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: switch port {text!r} is not a number") from None
    if not 0 <= n < (1 << PORT_BITS):
        raise ConfigError(f"{what}: switch port {n} out of range 0..{(1 << PORT_BITS) - 1}")
    return n


def parse_drop(spec: dict, what: str) -> dict[str, float]:
    if not isinstance(spec, dict):
        raise ConfigError(f"{what}: expected a mapping of {', '.join(DROP_KEYS)} to probabilities, got {spec!r}")
    out = {}
    for k, v in spec.items():
        if k not in DROP_KEYS:
            raise ConfigError(f"{what}: unknown key {k!r}; allowed: {', '.join(DROP_KEYS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ConfigError(f"{what}: {k} probability {v!r} must be in [0, 1]")
        out[k] = float(v)
    return out


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's error as one line: `line L, column C: problem` (its own text spans several lines,
    quoting the offending source with a caret)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def load_daemon_config(path: str | Path | None) -> DaemonConfig:
    """Read a YAML file shaped like switch.example.yaml (None: all defaults)."""
    if path is None:
        return DaemonConfig()
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read switch config {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"switch config {path} is not UTF-8 text (byte {e.start}): give a YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"switch config {path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"switch config {path}: the top level must be a mapping")
    return daemon_config_from_dict(raw, str(path))


def daemon_config_from_dict(raw: dict, where: str = "config") -> DaemonConfig:
    raw = dict(raw)
    switch_keys = {f.name for f in fields(SwitchConfig)}
    daemon_keys = {"ports", "ifaces", "drop", "runtime", "stats_file", "stats_interval", "p4runtime", "p4info"}
    unknown = set(raw) - switch_keys - daemon_keys
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}; allowed: "
                          f"{', '.join(sorted(switch_keys | daemon_keys))}")
    sw = SwitchConfig(**{k: raw[k] for k in switch_keys if k in raw})
    cfg = DaemonConfig(switch=sw)
    for key, val in (raw.get("ports") or {}).items():
        n = switch_port_number(key, f"{where}: ports")
        if val == SHM_PORT:
            cfg.shm_ports.add(n)
            continue
        if isinstance(val, str):
            val = {"listen": val}
        if not isinstance(val, dict) or "listen" not in val:
            raise ConfigError(f"{where}: ports.{key} needs listen: HOST:PORT (and optionally peer: HOST:PORT), "
                              f"or is {SHM_PORT}")
        extra = set(val) - {"listen", "peer"}
        if extra:
            raise ConfigError(f"{where}: ports.{key}: unknown keys {', '.join(sorted(extra))} (listen, peer)")
        peer = parse_peer(val["peer"], f"{where}: ports.{key}.peer") if val.get("peer") else None
        cfg.ports[n] = UdpPortSpec(parse_hostport(val["listen"], f"{where}: ports.{key}.listen"), peer)
    for key, val in (raw.get("ifaces") or {}).items():
        n = switch_port_number(key, f"{where}: ifaces")
        if n in cfg.ports or n in cfg.shm_ports:
            kind = "shm" if n in cfg.shm_ports else "UDP"
            raise ConfigError(f"{where}: switch port {n} is both a{'n' if kind == 'shm' else ''} {kind} port and an "
                              f"interface; give it one attachment")
        cfg.ifaces[n] = str(val)
    for key, val in (raw.get("drop") or {}).items():
        name = "all" if str(key) == "all" else str(switch_port_number(key, f"{where}: drop"))
        cfg.drop[name] = parse_drop(val, f"{where}: drop.{key}")
    for key in ("runtime", "stats_file", "p4runtime", "p4info"):
        if raw.get(key) is not None:
            setattr(cfg, key, str(raw[key]))
    if "stats_interval" in raw:
        v = raw["stats_interval"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.05 <= v <= 3600:
            raise ConfigError(f"{where}: stats_interval {v!r} must be seconds in [0.05, 3600]")
        cfg.stats_interval = float(v)
    return cfg
