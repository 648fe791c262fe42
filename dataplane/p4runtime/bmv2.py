"""Program a P4Runtime switch (BMv2's simple_switch_grpc) from a luwu runtime JSON, with finsy.

`program()` sets the forwarding pipeline (BMv2 JSON + P4Info; forced, which on BMv2 also
resets every register) and writes the runtime's table entries and multicast groups;
`read_counters()` reads the indirect counters back as the software switch reports them
(`{"drops": {code: (packets, bytes)}, "events": ..., "rx_types": ..., "session_packets": ...}`,
the ingress and egress drop counters summed). BMv2's device id is 0; finsy's default (1)
makes the pipeline push fail with a bare cancellation, so it is always passed explicitly.

    luwu p4 load --addr 127.0.0.1:50051 --runtime p4/runtime/star4.json
"""

from __future__ import annotations

from pathlib import Path

import finsy as fy

from luwu.dataplane.p4runtime.entries import P4InfoIndex, RuntimeConfig, parse_value

BMV2_DEVICE_ID = 0
# counter name in P4Info -> the counters() family it adds to
COUNTER_FAMILIES = {
    "LuwuIngress.drops": "drops",
    "LuwuEgress.drops": "drops",
    "LuwuIngress.events": "events",
    "LuwuIngress.rx_types": "rx_types",
    "LuwuIngress.session_packets": "session_packets",
}


def entities(cfg: RuntimeConfig, index: P4InfoIndex) -> list:
    """finsy entities for every table entry and multicast group of `cfg` (validated first)."""
    cfg.validate(index)
    out: list[fy.P4TableEntry | fy.P4MulticastGroupEntry] = []
    for entry in cfg.table_entries:
        table = index.table(entry.table, entry.table)
        action = index.action(entry.action_name, entry.table)
        widths = {p.name: p.bitwidth for p in action.params}
        params = {name: parse_value(v, widths[name], name) for name, v in entry.action_params.items()}
        act = fy.P4TableAction(action.preamble.name, **params)
        if entry.default_action:
            out.append(~fy.P4TableEntry(table.preamble.name, action=act, is_default_action=True))
            continue
        match: dict[str, int | tuple[int, int]] = {}
        for f in table.match_fields:
            value = entry.match[f.name]
            if f.match_type == f.LPM:
                match[f.name] = (parse_value(value[0], f.bitwidth, f.name), int(value[1]))
            else:
                match[f.name] = parse_value(value, f.bitwidth, f.name)
        out.append(+fy.P4TableEntry(table.preamble.name, match=fy.P4TableMatch(match), action=act,
                                    priority=entry.priority or 0))
    for group in cfg.multicast_group_entries:
        out.append(+fy.P4MulticastGroupEntry(group.multicast_group_id,
                                             replicas=[(r.egress_port, r.instance) for r in group.replicas]))
    return out


def switch_for(address: str, p4info: Path, bmv2_json: Path | None, device_id: int = BMV2_DEVICE_ID,
               force: bool = True, credentials=None) -> fy.Switch:
    """`credentials`: finsy channel credentials (TLS and/or a bearer token), None for plaintext."""
    options = fy.SwitchOptions(p4info=Path(p4info), p4blob=Path(bmv2_json) if bmv2_json else None,
                               device_id=device_id, p4force=force, channel_credentials=credentials)
    return fy.Switch("luwu", address, options)


async def write_runtime(sw: fy.Switch, cfg: RuntimeConfig) -> int:
    ents = entities(cfg, P4InfoIndex.load(sw.p4info.p4info))
    await sw.write(ents)
    return len(ents)


async def read_counters(sw: fy.Switch) -> dict:
    out: dict = {family: {} for family in set(COUNTER_FAMILIES.values())}
    for name, family in COUNTER_FAMILIES.items():
        if sw.p4info.counters.get(name) is None:
            raise KeyError(f"the switch's P4Info has no counter {name}: is it running luwu_v1model.p4?")
        # finsy's overloads type read() as a coroutine; it is an async generator (its own examples iterate it)
        async for entry in sw.read(fy.P4CounterEntry(name)):  # type: ignore[attr-defined]
            if entry.index is None:
                continue
            packets, nbytes = out[family].get(entry.index, (0, 0))
            out[family][entry.index] = (packets + entry.packet_count, nbytes + entry.byte_count)
    return out


def resolve(cfg_path: Path, name: str) -> Path:
    """A runtime JSON's p4info/bmv2_json path: relative ones are relative to the JSON file."""
    path = Path(name)
    return path if path.is_absolute() else (cfg_path.parent / path).resolve()


async def load(address: str, runtime: Path, p4info: Path | None = None, bmv2_json: Path | None = None,
               device_id: int = BMV2_DEVICE_ID, credentials=None) -> int:
    """Push the pipeline and the runtime JSON to the switch at `address`; returns entities written.
    `credentials`: finsy channel credentials for an authenticated switch (luwu/p4_command.py builds them)."""
    cfg = RuntimeConfig.load(runtime)
    p4info = p4info or resolve(runtime, cfg.p4info)
    bmv2_json = bmv2_json or resolve(runtime, cfg.bmv2_json)
    missing = [str(p) for p in (p4info, bmv2_json) if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"missing {', '.join(missing)}: run `luwu p4 build` (needs p4c) first")
    sw = switch_for(address, p4info, bmv2_json, device_id, credentials=credentials)
    async with sw:
        return await write_runtime(sw, cfg)
