"""What an endpoint needs to know about the sessions it takes part in.

The controller's plan (or the embedded launcher, when there is no controller) hands every
engine a `Wiring` (where its switch port is) and `SessionSpec`s (one per session). The switch
side of the same sessions is programmed from the same plan (docs/protocol.md, 6.1). Both are
plain dataclasses that round-trip through JSON, so they travel over gRPC, files or the
torch.distributed store unchanged.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from .protocol import MAX_CONTRIBUTORS, MAX_SESSIONS, check_pool

KINDS = ("collective", "node")


@dataclass
class SessionSpec:
    session: int  # switch-level id, 1..MAX_SESSIONS-1
    kind: str  # "collective": ALLREDUCE -> multicast RESULT; "node": GRAD -> node, PARAM <- node
    epoch: int  # slot ownership tag; new for every session instance
    pool_base: int  # same slot range on every switch of the session's tree
    pool_size: int  # power of two; also the aggregation window
    num_workers: int  # N: all contributors of a reduction (for the fixed-point headroom)
    lanes: int  # elements per aggregation packet (the switch's packet mode)
    param_window: int = 256  # PARAM stream window (node sessions), packets
    node_rank: int | None = None  # which optimizer node serves a node session (index in the plan)
    purpose: str = "data"  # "meta" (exponent passes) or "data" for collective sessions

    def validate(self) -> None:
        if not 1 <= self.session < MAX_SESSIONS:
            raise ValueError(f"session id {self.session} out of range 1..{MAX_SESSIONS - 1}")
        if self.kind not in KINDS:
            raise ValueError(f"session kind {self.kind!r} must be one of {KINDS}")
        check_pool(self.pool_base, self.pool_size)
        if not self.num_workers >= 1:
            raise ValueError(f"session {self.session}: num_workers must be >= 1")
        if not 0 <= self.epoch < 2**32:
            raise ValueError(f"session {self.session}: epoch must fit in 32 bits")


@dataclass
class Wiring:
    """How an endpoint reaches its switch.

    transport "udp": the endpoint's socket binds `local` and sends to the switch port socket
    `switch` (loopback / software switch). transport "ip": the endpoint binds `local` (its own
    address, UDP port = the luwu port) and sends to the switch's service address `switch`;
    the switch rewrites destinations from its `endpoints` table (Mininet, BMv2, Tofino).
    transport "shm": the switch runs on this host and its port is a pair of shared-memory rings;
    `switch` is (the rings' path prefix in /dev/shm, 0) and `local` is unused
    (`luwu.dataplane.net.shm_ring`, `SoftwareSwitch.attach_shm`).
    """

    rank: int  # worker rank, or 0xFFFF for an optimizer node
    transport: str = "udp"
    local: tuple[str, int] = ("127.0.0.1", 0)
    switch: tuple[str, int] = ("127.0.0.1", 0)
    switch_port: int = 0  # the switch's port number this endpoint is wired to


# -- a switch port's address, as the switch reports it and the controller hands it on ----------------
SHM_SCHEME = "shm:"  # "shm:/dev/shm/NAME": the port is the ring pair NAME.up / NAME.down of a switch on this host
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def shm_port_address(prefix: str) -> str:
    """The address of a shared-memory switch port whose rings are `prefix`.up/.down."""
    return SHM_SCHEME + prefix


def split_host_port(text: str, what: str) -> tuple[str, int]:
    """"HOST:PORT" (port 1..65535) -> (host, port); a ValueError naming `what` otherwise."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} must look like HOST:PORT (port 1..65535)")
    return host, int(port)


def parse_port_address(text: str, what: str) -> tuple[str, tuple[str, int]]:
    """A software switch port's address -> (transport, `Wiring.switch`).

    The one syntax for it (`luwu switch`'s ready line and registration, the controller's
    validation and plans): "HOST:PORT" is a UDP port, ("udp", (host, port)); "shm:/dev/shm/NAME"
    is a shared-memory port made by a switch on this host, ("shm", ("/dev/shm/NAME", 0)).

    Args:
        text: the address.
        what: how an error names it (e.g. "switch s1 port 3: udp_address").

    Returns:
        (transport, switch) for a `Wiring`.

    Raises:
        ValueError: one line saying what the address must look like.

    Example::

        parse_port_address("shm:/dev/shm/luwu-sw-42-0-p1", "port 1")  # ("shm", ("/dev/shm/luwu-sw-42-0-p1", 0))
    """
    if text.startswith(SHM_SCHEME):
        path = text[len(SHM_SCHEME):]
        head, _, name = path.rpartition("/")
        if head != SHM_DIR or not _SHM_NAME.fullmatch(name):
            raise ValueError(f"{what} {text!r}: a shared-memory port is {SHM_SCHEME}{SHM_DIR}/NAME (NAME of letters, "
                             f"digits, '_', '-', '.', not starting with '.')")
        return "shm", (path, 0)
    try:
        return "udp", split_host_port(text, what)
    except ValueError:
        raise ValueError(f"{what} {text!r} must look like HOST:PORT (port 1..65535) or "
                         f"{SHM_SCHEME}{SHM_DIR}/NAME") from None


@dataclass
class EndpointPlan:
    wiring: Wiring
    sessions: list[SessionSpec] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EndpointPlan:
        raw = json.loads(text)
        w = raw["wiring"]
        wiring = Wiring(w["rank"], w["transport"], tuple(w["local"]), tuple(w["switch"]), w.get("switch_port", 0))
        sessions = [SessionSpec(**s) for s in raw["sessions"]]
        for s in sessions:
            s.validate()
        return cls(wiring, sessions)

    @classmethod
    def from_file(cls, path, what: str = "--plan") -> EndpointPlan:
        """The plan in a JSON file; a missing, unreadable or malformed file raises UserError
        (one line naming the file and what is wrong), never a traceback."""
        from .process.usage import UserError

        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{what} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        try:
            return cls.from_json(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{what} {path}: not JSON ({e}); expected an endpoint plan "
                            "(luwu.dataplane.session.EndpointPlan)") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{what} {path}: not a valid endpoint plan ({type(e).__name__}: {e})") from None


def worker_bit(local_index: int) -> int:
    if not 0 <= local_index < MAX_CONTRIBUTORS:
        raise ValueError(f"at most {MAX_CONTRIBUTORS} contributors per session per switch, got index {local_index}")
    return 1 << local_index
