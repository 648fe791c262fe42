"""Direct moves: blocks that have exactly one receiver go from their owner to that receiver over the
group's TCP channel (luwu.worker.p2p), each byte once.

gather, scatter and all_to_all move blocks meant for one rank each. The switch sums and multicasts:
carried through it as a zero-padded sum, every block would reach every rank (all_to_all: world_size
times the bytes each rank needs, and every rank's upstream padded to the whole matrix). Gloo moves
them point to point too; docs/backend.md lists which path each collective takes.

An exchange is one collective's set of sends and receives, matched by a tag that every rank draws
in the scheduler's submission order (c10d calls collectives in one order on every rank), so
exchanges of different collectives never mix and may complete in any order. Tags from
DIRECT_TAG_BASE up are reserved: user send/recv tags are non-negative and the exact fallback's start
at -2^62.
"""

from __future__ import annotations

import numpy as np

from luwu.dataplane.engine import Handle

DIRECT_TAG_BASE = -(2**61)


class DirectMoves:
    """The direct exchanges of one process group over its P2PChannel (use from the submit thread)."""

    def __init__(self, p2p, rank: int, world_size: int):
        self.p2p = p2p
        self.rank = rank
        self.world_size = world_size
        self._next = 0
        self.stats = {"exchanges": 0, "bytes_sent": 0}

    def exchange(self, name: str, sends: dict[int, np.ndarray], sources: list[int]) -> tuple[list[Handle],
                                                                                                dict[int, Handle]]:
        """Send `sends[dst]` to each dst and receive one message from each rank in `sources`.

        Returns the send handles (result None once the bytes are handed to the kernel) and, per
        source, a handle whose result is the received bytes (a uint8 array). Every rank calls this
        once per collective, in the same collective order, even with nothing to send or receive.
        """
        tag = DIRECT_TAG_BASE + self._next
        self._next += 1
        self.stats["exchanges"] += 1
        sent = []
        for dst, payload in sends.items():
            h = Handle(f"{name}: send to rank {dst}")
            data = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
            self.stats["bytes_sent"] += int(data.size)
            self.p2p.send(dst, tag, data, lambda err, h=h, dst=dst: _settle(h, err, None, f"sending to rank {dst}"))
            sent.append(h)
        received = {}
        for src in sources:
            h = Handle(f"{name}: receive from rank {src}")
            box: list = []
            self.p2p.recv(src, tag, box.append,
                          lambda err, h=h, src=src, box=box: _settle(
                              h, err, np.frombuffer(box[0], dtype=np.uint8) if box else None,
                              f"receiving from rank {src}"))
            received[src] = h
        return sent, received


def _settle(h: Handle, err: BaseException | None, result, what: str) -> None:
    if err is not None:
        h.set_error(RuntimeError(f"luwu {h.name.split(':')[0]}: {what} failed: {err}"))
    else:
        h.set_result(result)
