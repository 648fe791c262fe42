"""Per-link settings from the command line and per-link traffic in the report.

`--link SWITCH:PORT=bw=MBIT,drop=P` (repeatable) overrides `--bw` and `--drop` on the link at one
switch port: the bandwidth shapes that link's two ends (tc htb, as `--bw` does for every link) and
the loss is the P4 drop simulator's on that port's ingress. The report lists, per switch port, who
is on the other end, the settings and the packets the switch counted (software switch; BMv2 does
not count per port).
"""

from __future__ import annotations

from dataclasses import dataclass

from .emulation import EmulationSpec


class LinkOptionError(ValueError):
    """A --link option that names no link or sets nothing valid."""


@dataclass
class LinkSetting:
    switch: str
    port: int
    bw_mbit: float | None = None
    drop: float | None = None


def parse(values: list[str]) -> list[LinkSetting]:
    """`SWITCH:PORT=bw=MBIT,drop=P` strings -> settings (syntax checked here, names in `apply`)."""
    out = []
    for raw in values or []:
        where, _, what = raw.partition("=")
        switch, _, port = where.partition(":")
        if not switch or not port.isdigit() or not what:
            raise LinkOptionError(f"--link {raw}: write SWITCH:PORT=bw=MBIT,drop=P (e.g. s1:2=bw=100,drop=0.01)")
        s = LinkSetting(switch, int(port))
        for item in what.split(","):
            key, _, value = item.partition("=")
            try:
                number = float(value)
            except ValueError:
                raise LinkOptionError(f"--link {raw}: {item!r} is not KEY=NUMBER") from None
            if key == "bw" and number >= 0:
                s.bw_mbit = number
            elif key == "drop" and 0.0 <= number < 1.0:
                s.drop = number
            else:
                raise LinkOptionError(f"--link {raw}: {item!r}: use bw=MBIT (>= 0) and drop=P (a probability in [0, 1))")
        out.append(s)
    return out


def apply_bandwidth(spec: EmulationSpec, settings: list[LinkSetting]) -> None:
    """Set each named link's bandwidth in the emulation spec (unknown switch or port: LinkOptionError)."""
    for s in settings:
        ifname = _port_ifname(spec, s)
        if s.bw_mbit is None:
            continue
        for link in spec.links:
            if (link.a, link.a_intf) == (s.switch, ifname) or (link.b, link.b_intf) == (s.switch, ifname):
                link.bw_mbit = s.bw_mbit


def port_drops(spec: EmulationSpec, settings: list[LinkSetting], default: float) -> dict[str, dict[int, float]]:
    """switch -> port -> ingress loss probability: `default` everywhere, the --link ones where given."""
    drops = {sw.name: dict.fromkeys(sw.ports, default) for sw in spec.switches}
    for s in settings:
        _port_ifname(spec, s)
        if s.drop is not None:
            drops[s.switch][s.port] = s.drop
    return drops


def _port_ifname(spec: EmulationSpec, s: LinkSetting) -> str:
    try:
        sw = spec.switch(s.switch)
    except KeyError:
        raise LinkOptionError(f"--link {s.switch}:{s.port}: no switch {s.switch!r} here (switches: "
                              f"{', '.join(x.name for x in spec.switches)})") from None
    if s.port not in sw.ports:
        raise LinkOptionError(f"--link {s.switch}:{s.port}: switch {s.switch} has ports {sorted(sw.ports)}")
    return sw.ports[s.port]


def traffic(spec: EmulationSpec, drops: dict[str, dict[int, float]], counters: dict[str, dict]) -> list[dict]:
    """One entry per switch port: the peer, bandwidth, loss and the packets the switch counted."""
    out = []
    for sw in spec.switches:
        ports = (counters.get(sw.name) or {}).get("ports", {})
        for port, ifname in sorted(sw.ports.items()):
            link = next((lk for lk in spec.links if (lk.a, lk.a_intf) == (sw.name, ifname)
                         or (lk.b, lk.b_intf) == (sw.name, ifname)), None)
            peer = "" if link is None else (link.b if link.a == sw.name else link.a)
            seen = ports.get(str(port), {})
            out.append({"switch": sw.name, "port": port, "peer": peer,
                        "bw_mbit": link.bw_mbit if link is not None else 0.0,
                        "drop": drops.get(sw.name, {}).get(port, 0.0),
                        "rx_packets": seen.get("rx_packets"), "tx_packets": seen.get("tx_packets")})
    return out
