"""report.json's traffic.push_breakdown (luwu/demo/push_bytes.py): the bytes of a step's pushes
split by what they carry, from the units' sizes and the packet layout, adding up to the packets sent;
tests/engine/test_fixed16_engine.py checks the same arithmetic against a real engine's socket."""

from __future__ import annotations

import pytest

from luwu.dataplane import fixed16
from luwu.dataplane.integrity import FIXED16_BLOCK, FIXED16_MIN_LANES
from luwu.dataplane.protocol import LANE_CHUNK
from luwu.demo import push_bytes
from luwu.demo.model import GPTConfig, build
from luwu.worker.model_in_network.units import split_units


def _units(d_model: int, layers: int, heads: int) -> list[int]:
    cfg = GPTConfig(vocab=72, d_model=d_model, n_layers=layers, n_heads=heads, context=64)
    return [u.numel for u in split_units(build(cfg, 0))]


def test_the_tiny_demo_pays_only_whole_chunks():
    """The default tiny demo (0.82M parameters, 7 units, loopback packets): 31 data packets and one
    agreement packet per unit, every byte of them accounted for; each unit's last data packet and
    its agreement packet are cut to whole chunks of LANE_CHUNK lanes (docs/protocol.md 3.3): 2.064
    B/param, under issue 29's 2.1 (2.073 with 16-bit lanes, 2.464 with whole packets)."""
    units = _units(128, 4, 4)
    params = sum(units)
    assert len(units) == 7 and params == 819968
    s = push_bytes.structure(units, 16000, "fixed16")
    nb, per = fixed16.layout(16000)
    assert s["data"]["packets"] == sum(-(-u // per) for u in units) == 31
    assert s["agreement"]["packets"] == 7
    blocks = [-(-u // FIXED16_BLOCK) for u in units]
    # every packet by hand: whole ones, and each unit's last data packet and its agreement packet cut
    # to the fewest chunks holding exponent slots and data (two per lane) and 4 check lanes, or one
    # exponent lane per block and 4 check lanes
    whole = fixed16.row_len(16000)
    lengths = []
    for u, b in zip(units, blocks):
        k = -(-u // per)
        lengths += [whole] * (k - 1)
        lengths.append(32 + 4 * LANE_CHUNK * -(-(-(-(nb + u - (k - 1) * per) // 2) + 4) // LANE_CHUNK))
        lengths.append(32 + 4 * LANE_CHUNK * -(-(b + 4) // LANE_CHUNK))
    assert s["bytes"] == sum(lengths) + push_bytes.WIRE * len(lengths)
    assert s["data"]["data_lanes"] == 2 * params
    assert s["data"]["exponent_lanes"] == 2 * sum(blocks)  # an int16 slot each
    assert s["agreement"]["exponent_lanes"] == 4 * sum(blocks)  # a self-checking int32 lane each
    assert all(s[k][p] >= 0 for k in ("data", "agreement") for p in push_bytes.PARTS)
    assert s["agreement"]["padding"] < 7 * 4 * LANE_CHUNK
    assert s["bytes_per_param"] == pytest.approx(2.0643, abs=1e-4)
    assert push_bytes.structure(units, 16000, "fixed32")["bytes_per_param"] == pytest.approx(4.0101, abs=1e-4)


def test_the_large_demo_is_within_the_target():
    """The 28.5M-parameter demo (--d-model 768 --layers 4 --heads 12): 2.057 B/param before
    heartbeats and resends (2.069 with 16-bit lanes)."""
    units = _units(768, 4, 12)
    s = push_bytes.structure(units, 16000, "fixed16")
    assert s["bytes_per_param"] <= 2.1
    assert s["bytes_per_param"] == pytest.approx(2.0574, abs=1e-4)


def test_breakdown_sets_the_engines_counters_beside_the_structure():
    units = [5000, 70]
    s = push_bytes.structure(units, 300, "fixed16")
    packets = s["data"]["packets"] + s["agreement"]["packets"]
    row = s["bytes"] / packets - push_bytes.WIRE  # a resend's luwu bytes, as breakdown counts them: the mean
    luwu_bytes = s["bytes"] - push_bytes.WIRE * packets
    steps, heartbeats = 3, 10

    def engine(resent, nbytes=None):  # one worker's engine stats after `steps` steps
        stream = {"packets": 9, "retransmitted": resent}
        if nbytes is not None:
            stream["retransmitted_bytes"] = nbytes
        return {"socket": {"tx_bytes": steps * luwu_bytes + (nbytes if nbytes is not None else resent * row)
                           + heartbeats * 32, "tx_packets": steps * packets + resent + heartbeats},
                "session 1": {"send_stream": stream}}

    # engines that count their resends' bytes (two packets of 160 and 632 bytes resent)
    reports = {0: {"mnn": {"engine": engine(2, 792)}}, 1: {"mnn": {"engine": engine(0, 0)}}}
    b = push_bytes.breakdown(reports, steps, units, 300, "fixed16")
    assert b["structural_bytes_per_param"] == s["bytes_per_param"]
    per_step = b["per_step_bytes"]
    assert per_step["resent"] == pytest.approx((792 + 2 * push_bytes.WIRE) / (2 * steps))
    assert per_step["other"] == pytest.approx(heartbeats * (32 + push_bytes.WIRE) / steps)
    total = sum(per_step.values())
    assert total / sum(units) == pytest.approx(b["measured_bytes_per_param"])
    assert b["streams_all_workers"] == {"session 1 send_stream": {"packets": 18, "retransmitted": 2,
                                                                  "retransmitted_bytes": 792}}
    # engines that do not: each resend at the mean packet length
    reports = {0: {"mnn": {"engine": engine(2)}}, 1: {"mnn": {"engine": engine(0)}}}
    per_step = push_bytes.breakdown(reports, steps, units, 300, "fixed16")["per_step_bytes"]
    assert per_step["resent"] == pytest.approx(2 * (row + push_bytes.WIRE) / (2 * steps))
    # (the counters are whole bytes; the mean length of a resend is not: within a byte)
    assert per_step["other"] == pytest.approx(heartbeats * (32 + push_bytes.WIRE) / steps, abs=1)


def test_a_switch_too_small_for_a_block_is_counted_as_fixed32():
    """Packets narrower than FIXED16_MIN_LANES hold no FIXED16 block: the engine pushes fixed32, and
    so does the count. Tofino's 64 lanes hold one block of 112 (2.61 B/param against 4.80)."""
    units = [1000]
    narrow = FIXED16_MIN_LANES - 1
    s = push_bytes.structure(units, narrow, "fixed32")
    reports = {0: {"mnn": {"engine": {"socket": {"tx_bytes": s["bytes"], "tx_packets": 0}}}}}
    b = push_bytes.breakdown(reports, 1, units, narrow, "fixed16")
    assert b["grad_format"] == "fixed32" and b["structural_bytes_per_param"] == s["bytes_per_param"]
    with pytest.raises(ValueError):
        push_bytes.structure(units, narrow, "fixed16")
    assert fixed16.layout(64) == (1, FIXED16_BLOCK)
