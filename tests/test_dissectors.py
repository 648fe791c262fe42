"""Captures decode by themselves: the scapy layer and the Wireshark dissector (`luwu wireshark`,
run by real tshark where it is installed) recognise luwu by the header's signature on any UDP
port, and leave other UDP alone."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import wrpcap

from luwu.dataplane.integrity import sealed, trailer
from luwu.dataplane.protocol import NODE, VERSION, Dtype, Flag, MsgType, Packet, looks_like_luwu
from luwu.dataplane.scapy_layer import Luwu

GOOD = Packet(MsgType.ALLREDUCE, 2, worker=1, count=4, seq=7, payload=np.arange(4, dtype=">i4").tobytes()).pack()
CORRUPTED = GOOD[:10] + bytes([GOOD[10] ^ 0x01]) + GOOD[11:]

PACKETS = [  # (payload, what a dissector must say: (type, session, worker, seq) or None)
    (Packet(MsgType.ALLREDUCE, 2, worker=1, count=4, seq=7, flags=int(Flag.SET | Flag.RETX),
            payload=np.arange(4, dtype=">i4").tobytes()).pack(), (3, 2, 1, 7)),
    (Packet(MsgType.HEARTBEAT, 3, worker=NODE, seq=9, ack=5, credit=12).pack(), (6, 3, NODE, 9)),
    (Packet(MsgType.PARAM, 3, worker=NODE, count=3, dtype=int(Dtype.BF16), tensor=4,
            payload=b"\0" * 6 + trailer(b"\0" * 6)).pack(), (5, 3, NODE, 0)),
    (b"not luwu at all: forty bytes of ascii..", None),
    (Packet(MsgType.PARAM, 3, count=3, dtype=int(Dtype.BF16), payload=b"\0" * 7).pack(), None),  # bad length
    (sealed(bytes([((VERSION + 1) << 4) | 3]) + bytes(31)), None),  # another version
    # a corrupted header (one bit of seq flipped): still dissected, its header check marked bad
    (CORRUPTED, (3, 2, 1, 7 ^ 0x100)),
    # a header-only ZERO contribution (protocol.md 3.2): INT32 only
    (Packet(MsgType.ALLREDUCE, 2, worker=3, count=64, seq=11, flags=int(Flag.ZERO), dtype=int(Dtype.INT32)).pack(),
     (3, 2, 3, 11)),
    (Packet(MsgType.ALLREDUCE, 2, worker=3, count=64, seq=11, flags=int(Flag.ZERO), dtype=int(Dtype.FIXED32)).pack(),
     None),
]


def _frames():
    return [Ether() / IP(src="127.0.0.1", dst="127.0.0.1") / UDP(sport=41000 + i, dport=52000) / Raw(p)
            for i, (p, _) in enumerate(PACKETS)]


def test_signature_and_scapy_on_ephemeral_ports():
    for frame, (payload, want) in zip(_frames(), PACKETS):
        assert looks_like_luwu(payload) == (want is not None), payload[:8]
        back = Ether(bytes(frame))
        if want is None:
            assert Luwu not in back
        else:
            h = back[Luwu]
            assert (h.type, h.session, h.worker, h.seq) == want
            assert h.hcheck_ok() == (payload is not CORRUPTED)


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark is not installed (apt-get install tshark)")
def test_wireshark_dissector_with_tshark(tmp_path):
    lua = tmp_path / "luwu.lua"
    out = subprocess.run([sys.executable, "-m", "luwu.cli", "wireshark", "--out", str(lua)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cap = tmp_path / "cap.pcap"
    wrpcap(str(cap), _frames())
    res = subprocess.run(["tshark", "-X", f"lua_script:{lua}", "-r", str(cap), "-T", "fields", "-e", "luwu.type",
                          "-e", "luwu.session", "-e", "luwu.worker", "-e", "luwu.seq", "-e", "luwu.hcheck.bad"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split("\t") for line in res.stdout.splitlines()]
    assert len(rows) == len(PACKETS), res.stdout
    for row, (payload, want) in zip(rows, PACKETS):
        got = tuple(int(v) for v in row[:4]) if any(row[:4]) else None
        assert got == want, (row, want)
        bad = len(row) > 4 and row[4] not in ("", "0", "False")
        assert bad == (payload is CORRUPTED), row
