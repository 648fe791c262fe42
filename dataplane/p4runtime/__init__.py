"""The P4Runtime facts that the controller, the software switch and BMv2 share (the wire layer).

One place below all three, so none of them imports another's modules for what they must agree on:
- where the P4 program's build lives (`P4_DIR`, `BUILD_DIR`, `P4INFO_TXTPB`: the P4Info every
  P4Runtime client and server checks names against; `luwu.p4` re-exports them);
- `entries.py`: table entries and multicast groups as runtime JSON, and their builders (the one
  place switch table entries are built);
- how a writer proves itself: `AUTH_METADATA` carries `Bearer switch_token(admin token, name)`,
  certificates carry a role as the SAN URI `ROLE_URI_PREFIX + role` (`CERT_ROLES`), and a bearer
  token travels in clear text only to a loopback peer (`is_loopback`); `credentials.py` builds
  the client side (the controller, `luwu p4 load`), dataplane/switch/p4runtime_auth.py checks
  them on the software switch;
- `device_config_marker`: the p4_device_config a controller sends a software switch, which has
  no compiled program;
- `audit.py`: the JSON-lines log of P4Runtime writes that both ends keep.
- `bmv2.py`: a runtime JSON pushed to a P4Runtime switch with finsy (BMv2's device id 0) and its
  counters read back: the client side of `luwu p4 load`, `luwu bmv2` and the conformance suite.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from pathlib import Path

# dataplane/p4runtime/ -> the p4/ folder beside dataplane/ (repository: ./p4; installed: luwu/p4)
P4_DIR = Path(__file__).resolve().parents[2] / "p4"
BUILD_DIR = P4_DIR / "build"
P4INFO_TXTPB = BUILD_DIR / "p4info.txtpb"

AUTH_METADATA = "authorization"  # gRPC metadata key of the bearer token
_DERIVATION = b"luwu p4runtime writer v1:"
CONTROLLER, READER = "controller", "reader"
CERT_ROLES = (CONTROLLER, READER)  # what a client certificate may hold (`luwu certs issue --role`)
ROLE_URI_PREFIX = "urn:luwu:role:"  # a client certificate's role: SAN URI urn:luwu:role:ROLE


def switch_token(admin_token: str, switch_name: str) -> str:
    """The P4Runtime credential of switch `switch_name` in the deployment of `admin_token`.

    HMAC-SHA256 of the switch's name under the deployment's admin token, so the controller and a
    `luwu switch --controller` that registered under that name both know it without the admin
    token ever reaching a switch's P4Runtime port.

    Args:
        admin_token: the deployment's admin token (the controller's `--token-file`).
        switch_name: the name the switch registers under.

    Returns:
        64 hex characters; the same on the controller and on the switch.

    Examples:
        >>> len(switch_token("admin", "s1"))
        64
    """
    if not admin_token:
        raise ValueError("deriving a switch's P4Runtime token needs the deployment's admin token")
    return hmac.new(admin_token.encode(), _DERIVATION + switch_name.encode(), hashlib.sha256).hexdigest()


def is_loopback(address: str) -> bool:
    """True for HOST:PORT on a loopback host (127.0.0.0/8, ::1, localhost).

    Examples:
        >>> is_loopback("127.0.0.1:9559"), is_loopback("[::1]:9559"), is_loopback("10.0.0.1:9559")
        (True, True, False)
    """
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def device_config_marker(lanes: int, slots: int, name: str = "luwu-software-switch") -> bytes:
    """The p4_device_config a controller sends to a software switch (it has no compiled program).

    Args:
        lanes: the switch's lanes per slot.
        slots: its aggregation slots.
        name: the target's name.

    Returns:
        JSON bytes naming the target and its geometry.
    """
    return json.dumps({"target": name, "lanes": lanes, "slots": slots}).encode()
