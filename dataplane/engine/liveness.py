"""Failure named in seconds: an engine's watch on its switch and on the optimizer nodes it uses.

While operations are pending, the engine fails them with `LuwuPeerDead` (naming the component,
its address and how long it has been silent) instead of letting them wait for a caller's long
timeout, on either sign of death lasting `peer_timeout` seconds (EngineConfig, default 5 s;
docs/protocol.md 7.5):

* the switch: no packet at all from it, and the kernel reports its port unreachable (ICMP port
  unreachable, reported through IP_RECVERR: nothing listens there any more; the transport's
  `drain_errors`) or, on a shared-memory port, the switch's process (its pid in the ring header)
  has exited (the transport's `peer_gone`). Silence alone is not enough in a collective, where a
  slow peer also means silence;
* an optimizer node: no HEARTBEAT from it on a node session with pending pushes or pulls. A node
  sends one at least every keepalive (0.1 s) whatever its load, so silence is unambiguous. The
  switch carries those heartbeats: when its port is unreachable the switch is named instead (a
  remote switch that dies without ICMP looks like a dead node; the message says so).
"""

from __future__ import annotations

from .handles import EngineError

DEFAULT_PEER_TIMEOUT = 5.0  # s of silence before a pending operation's peer is declared dead


class LuwuPeerDead(EngineError):
    """A component the operation needs (the switch or an optimizer node) stopped answering.

    `component` is "switch" or "optimizer node", `address` where it was, `silent` the seconds
    since anything was heard from it.
    """

    def __init__(self, component: str, address: str, silent: float, detail: str):
        super().__init__(f"{component} {address} stopped answering {silent:.1f} s ago ({detail})")
        self.component = component
        self.address = address
        self.silent = silent


class PeerWatch:
    """The engine's clock of what it last heard, and the verdict when pending work starves."""

    def __init__(self, switch: tuple[str, int] | str, timeout: float, now: float):
        self.switch = switch if isinstance(switch, str) else f"{switch[0]}:{switch[1]}"
        self.timeout = timeout
        self.last_rx = now
        self.refused_at: float | None = None  # first "port unreachable" since the last packet
        self.refused_detail: str | None = None  # what said so, when not the kernel's ICMP report
        self.busy_since: float | None = None  # when pending work began (silence before it is not starvation)

    def heard(self, now: float) -> None:
        self.last_rx = now
        self.refused_at = None

    def refused(self, now: float, detail: str | None = None) -> None:
        """The switch's port is known gone (ICMP port unreachable, or `detail`: e.g. its process exited)."""
        if self.refused_at is None:
            self.refused_at = now
            self.refused_detail = detail

    def pending(self, busy: bool, now: float) -> None:
        if not busy:
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = now

    def verdict(self, now: float, node_sessions) -> LuwuPeerDead | None:
        """The dead component, if pending work has starved for `timeout`; else None.

        `node_sessions`: (session id, last node heartbeat time, has pending node work) triples.
        """
        if self.busy_since is None or self.timeout <= 0:
            return None
        silent = now - self.last_rx
        if self.refused_at is not None and now - max(self.last_rx, self.busy_since) >= self.timeout:
            why = self.refused_detail or ("nothing listens on its port any more: the kernel answered port "
                                          "unreachable")
            return LuwuPeerDead("switch", self.switch, silent, f"{why}; see the switch's log, restart it and the job")
        for sid, last_heard, waiting in node_sessions:
            if not waiting:
                continue
            quiet = now - max(last_heard, self.busy_since)
            if quiet < self.timeout:
                continue
            # the switch's port still takes packets (no port unreachable, checked above): the node is gone
            return LuwuPeerDead("optimizer node", f"of session {sid} (behind switch {self.switch})", now - last_heard,
                                "no heartbeat from it while pushes or pulls wait; see the node's log, or restart it "
                                "with `luwu node --restore latest` (a remote switch that died silently looks the "
                                "same: check it too)")
        return None
