"""Where a worker's push bytes go: report.json's traffic.push_breakdown (issue 29).

A push of a unit's gradient is its exponent agreement (a MAX on the meta session) and then its
data packets (GRAD), each cut to the whole chunks of LANE_CHUNK lanes its count needs
(docs/protocol.md 3.3, 6.7): a unit's last data packet and its agreement packets pay at most a
chunk's padding, not a whole packet's. This module splits the bytes of
one step's pushes, per worker, into what they carry (data lanes, exponent lanes, check words,
zero padding, luwu headers, UDP/IPv4/Ethernet headers), from the units' sizes and the packet
layout alone (dataplane/fixed16.py, integrity.py: the same arithmetic the senders do), and
sets beside them what the engine counted: resent packets and the rest of what it sent
(heartbeats, PULL requests). The structural part is exact, not measured; `structure` is what
tests check.

Example:
    >>> from luwu.demo.push_bytes import structure
    >>> round(structure([198272], 16000, "fixed16")["bytes_per_param"], 3)
    2.061
"""

from __future__ import annotations

from luwu.dataplane import fixed16
from luwu.dataplane.integrity import FIXED16_BLOCK, check_lanes, fixed16_blocks, wire_lanes
from luwu.dataplane.protocol import HEADER_LEN, Dtype, Flag

WIRE = 42  # UDP (8), IPv4 (20) and Ethernet (14) headers per packet, as report.WIRE_OVERHEAD

PARTS = ("data_lanes", "exponent_lanes", "check_lanes", "padding", "luwu_headers", "wire_headers")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _payload(numel: int, per: int, dtype: Dtype, flags: int, lanes: int) -> tuple[int, int]:
    """(packets, payload bytes) of `numel` lanes' worth of elements sent `per` to a packet, each
    packet cut to the whole chunks its count needs (integrity.wire_lanes, docs/protocol.md 3.3)."""
    k = _ceil(numel, per)
    if k == 0:
        return 0, 0
    last = numel - (k - 1) * per
    return k, 4 * ((k - 1) * wire_lanes(per, int(dtype), flags, lanes) + wire_lanes(last, int(dtype), flags, lanes))


def _packets(numel: int, lanes: int, grad_format: str) -> tuple[dict, dict]:
    """(data, agreement) of one push of `numel` elements: packet counts and bytes by part."""
    if grad_format == "fixed16":
        per = fixed16.layout(lanes)[1]
        blocks = _ceil(numel, FIXED16_BLOCK)
        k, payload = _payload(numel, per, Dtype.FIXED16, 0, lanes)
        checks = 4 * check_lanes(Dtype.FIXED16)  # 4 lanes: a 16-bit word in the high half of each
        data = {"packets": k, "data_lanes": 2 * numel, "exponent_lanes": 2 * blocks, "check_lanes": checks * k}
        ka, payload_a = _payload(blocks, fixed16.agreement_lanes(lanes), Dtype.FIXED16, int(Flag.MAX), lanes)
        agree = {"packets": ka, "data_lanes": 0, "exponent_lanes": 4 * blocks, "check_lanes": checks * ka}
    else:  # fixed32: one exponent per packet in the header, agreed in int32 lanes (collective.py)
        per = lanes - check_lanes(Dtype.FIXED32)
        k, payload = _payload(numel, per, Dtype.FIXED32, 0, lanes)
        checks = 4 * check_lanes(Dtype.FIXED32)
        data = {"packets": k, "data_lanes": 4 * numel, "exponent_lanes": 0, "check_lanes": checks * k}
        ka, payload_a = _payload(k, per, Dtype.INT32, int(Flag.MAX), lanes)
        agree = {"packets": ka, "data_lanes": 0, "exponent_lanes": 4 * k, "check_lanes": checks * ka}
    for part, nbytes in ((data, payload), (agree, payload_a)):
        n = part["packets"]
        part["luwu_headers"] = HEADER_LEN * n
        part["wire_headers"] = WIRE * n
        part["padding"] = nbytes - part["data_lanes"] - part["exponent_lanes"] - part["check_lanes"]
    return data, agree


def structure(units: list[int], lanes: int, grad_format: str) -> dict:
    """Bytes of one push of every unit (`units`: their element counts) on a switch of `lanes`
    lanes, by part, for the data packets and the exponent agreements, with UDP/IP/Ethernet headers.

    Args:
        units: element count of each unit's gradient (one push each per step).
        lanes: the switch's lane count (protocol.lanes_for_mode).
        grad_format: "fixed16" or "fixed32".

    Returns:
        {"data": {part: bytes, "packets": n}, "agreement": {...}, "bytes": total,
        "bytes_per_param": total / sum(units)}.
    """
    total: dict[str, dict] = {"data": dict.fromkeys(("packets", *PARTS), 0),
                              "agreement": dict.fromkeys(("packets", *PARTS), 0)}
    for numel in units:
        if numel <= 0:
            continue  # nothing to push (engine: an empty push completes at once)
        for name, part in zip(("data", "agreement"), _packets(int(numel), lanes, grad_format)):
            for key, value in part.items():
                total[name][key] += value
    nbytes = sum(total[name][p] for name in ("data", "agreement") for p in PARTS)
    return {**total, "bytes": nbytes, "bytes_per_param": nbytes / max(1, sum(int(u) for u in units))}


def _streams(engine_stats: dict | None) -> dict[str, dict[str, int]]:
    """Packets sent and resent by each stream of each session an engine sends on."""
    out = {}
    for key, entry in (engine_stats or {}).items():
        if key.startswith("session ") and isinstance(entry, dict):
            for stream in ("send_stream", "grad_stream"):
                st = entry.get(stream)
                if st:
                    out[f"{key} {stream}"] = {k: int(st.get(k, 0)) for k in ("packets", "retransmitted")}
                    if "retransmitted_bytes" in st:  # (engines before issue 29's short packets: absent)
                        out[f"{key} {stream}"]["retransmitted_bytes"] = int(st["retransmitted_bytes"])
    return out


def breakdown(reports: dict[int, dict], steps: int, units: list[int], lanes: int, grad_format: str) -> dict:
    """report.json's traffic.push_breakdown: `structure` per worker and step, in bytes and bytes
    per parameter, then what the engines counted beyond it: `resent` (the bytes of the packets
    resent, `retransmitted_bytes`; from an engine that does not count them, each resend at the
    step's mean packet length) and `other` (the rest of what they sent: heartbeats, PULL
    requests), from the same socket counters as push_bytes_per_param."""
    if grad_format == "fixed16" and fixed16_blocks(lanes) < 1:
        grad_format = "fixed32"  # packets too small for a block: the engine sends fixed32 (engine.push)
    s = structure(units, lanes, grad_format)
    params = max(1, sum(int(u) for u in units))
    ranks = sorted(reports)
    tx = sum(int(reports[r]["mnn"]["engine"]["socket"]["tx_bytes"]) for r in ranks)
    pk = sum(int(reports[r]["mnn"]["engine"]["socket"]["tx_packets"]) for r in ranks)
    streams: dict[str, dict[str, int]] = {}
    for r in ranks:
        for name, st in _streams(reports[r]["mnn"]["engine"]).items():
            for k, v in st.items():
                streams.setdefault(name, {}).setdefault(k, 0)
                streams[name][k] += v
    resent = sum(st["retransmitted"] for st in streams.values())
    per = max(1, len(ranks) * steps)
    measured = (tx + WIRE * pk) / per
    if all("retransmitted_bytes" in st for st in streams.values()):
        resent_bytes = (sum(st["retransmitted_bytes"] for st in streams.values()) + WIRE * resent) / per
    else:  # counters without lengths: each resend at the mean length of the step's packets
        resent_bytes = resent * s["bytes"] / max(1, s["data"]["packets"] + s["agreement"]["packets"]) / per
    out: dict = {"lanes": lanes, "grad_format": grad_format, "units": len(units), "params": params,
                 "note": "the structure is one push per unit; a unit sliced over several nodes pushes per "
                         "slice, and its extra packets count in `other`",
                 "per_step_bytes": {}, "per_param": {}}
    for name in ("data", "agreement"):
        out[f"{name}_packets_per_step"] = s[name]["packets"]
        for p in PARTS:
            out["per_step_bytes"][f"{name}.{p}"] = s[name][p]
    out["per_step_bytes"]["resent"] = resent_bytes
    out["per_step_bytes"]["other"] = measured - s["bytes"] - resent_bytes
    out["per_param"] = {k: v / params for k, v in out["per_step_bytes"].items()}
    out["structural_bytes_per_param"] = s["bytes_per_param"]
    out["measured_bytes_per_param"] = measured / params
    out["streams_all_workers"] = streams  # whole run, every rank
    return out
