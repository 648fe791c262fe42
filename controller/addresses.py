"""The one check for every address the controller's RPCs take (proto/controller.proto states the
rules next to each field; registry.py and core.py call these, and an error becomes
INVALID_ARGUMENT with the message).

Two kinds of address:

* **Data-plane** addresses (`JoinJobRequest.endpoint_address`, `Node.data_address`,
  `SwitchPort.udp_address`): `A.B.C.D:PORT`, an IPv4 address in dotted-quad form. The controller
  writes the IPv4 address into the switch's `endpoints` table (32 bits; the software switch takes
  a UDP port's datagrams only from the address there) and the engines' sockets are IPv4, so a host
  name (which the table cannot hold) or an IPv6 address is refused, never stored half-applied.
  `Node.data_address` and `SwitchPort.udp_address` may also be `shm:/dev/shm/NAME`.
* **Control-plane** addresses the controller dials (`Switch.p4runtime_address` over gRPC,
  `Switch.metrics_address` over HTTP): `A.B.C.D:PORT`, `HOSTNAME:PORT` (RFC 1123 labels) or
  `[IPV6]:PORT` (brackets required). They are stored exactly as given.

PORT is 1..65535 in ASCII digits.

    check_data_address("10.0.0.7:9100", "endpoint_address")       # ("10.0.0.7", 9100)
    check_control_address("[::1]:50051", "p4runtime_address")        # ("::1", 50051)
"""

from __future__ import annotations

import ipaddress
import re

from luwu.dataplane.session import SHM_DIR, SHM_SCHEME, parse_port_address

_PORT = re.compile(r"[0-9]{1,5}")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_DOTTED = re.compile(r"[0-9.]+")
DATA_FORM = "A.B.C.D:PORT (an IPv4 address and a port 1..65535)"
CONTROL_FORM = "A.B.C.D:PORT, HOSTNAME:PORT or [IPV6]:PORT (port 1..65535)"


def _split(text: str, what: str, form: str) -> tuple[str, int, bool]:
    """(host, port, bracketed) of `text`; a ValueError naming `what` and `form` otherwise."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"{what} is empty: it must be {form}")
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or not rest.startswith(":"):
            raise ValueError(f"{what} {text!r} must be {form}")
        port, bracketed = rest[1:], True
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            raise ValueError(f"{what} {text!r} has no port: it must be {form}")
        bracketed = False
        if ":" in host:
            raise ValueError(f"{what} {text!r} looks like an IPv6 address without brackets: it must be {form}")
    if not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r}: port {port[:16]!r} must be 1..65535; the address must be {form}")
    return host, int(port), bracketed


def _ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def check_data_address(text: str, what: str) -> tuple[str, int]:
    """A data-plane `A.B.C.D:PORT` -> (host, port).

    Args:
        text: the address as the RPC carried it.
        what: how the error names the field (e.g. "endpoint_address").

    Returns:
        The IPv4 address (as given) and the port.

    Raises:
        ValueError: one line naming `what` and the accepted form; IPv6 and host names say why
            they are not accepted here.

    Example::

        check_data_address("127.0.0.1:9100", "endpoint_address")  # ("127.0.0.1", 9100)
    """
    host, port, bracketed = _split(text, what, DATA_FORM)
    if bracketed:
        raise ValueError(f"{what} {text!r}: IPv6 is not accepted on the data plane (the switch's endpoints table "
                         f"holds an IPv4 address): it must be {DATA_FORM}")
    if not _ipv4(host):
        if _DOTTED.fullmatch(host):
            raise ValueError(f"{what} {text!r}: {host!r} is not an IPv4 address: it must be {DATA_FORM}")
        raise ValueError(f"{what} {text!r}: a host name is not accepted on the data plane (the switch's endpoints "
                         f"table holds an IPv4 address): it must be {DATA_FORM}")
    return host, port


def check_endpoint_address(text: str, what: str = "endpoint_address") -> tuple[str, int]:
    """JoinJob's `endpoint_address`: `check_data_address`, and not 0.0.0.0 (the switch takes the
    worker's datagrams only from the address given, and no datagram comes from 0.0.0.0).

    Example::

        check_endpoint_address("10.0.0.7:9100")  # ("10.0.0.7", 9100)
    """
    host, port = check_data_address(text, what)
    if ipaddress.IPv4Address(host).is_unspecified:
        raise ValueError(f"{what} {text!r}: 0.0.0.0 names no host; give the IPv4 address the worker's engine sends "
                         f"from: it must be {DATA_FORM}")
    return host, port


def check_port_address(text: str, what: str) -> tuple[str, tuple[str, int]]:
    """A data-plane address that may also be a shared-memory port (`Node.data_address`,
    `SwitchPort.udp_address`) -> (transport, address), as `parse_port_address` gives them.

    Example::

        check_port_address("shm:/dev/shm/luwu-sw-1-0-p1", "udp_address")  # ("shm", ("/dev/shm/...", 0))
    """
    if isinstance(text, str) and text.startswith(SHM_SCHEME):
        return parse_port_address(text, what)
    try:
        return "udp", check_data_address(text, what)
    except ValueError as exc:
        raise ValueError(f"{exc}, or {SHM_SCHEME}{SHM_DIR}/NAME (shared memory)") from None


def check_control_address(text: str, what: str) -> tuple[str, int]:
    """An address the controller dials (gRPC, HTTP) -> (host, port); the text itself is what
    is stored and dialled.

    Example::

        check_control_address("switch-3.rack1:9559", "p4runtime_address")  # ("switch-3.rack1", 9559)
    """
    host, port, bracketed = _split(text, what, CONTROL_FORM)
    if bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{what} {text!r}: {host[:64]!r} in brackets is not an IPv6 address: it must be "
                             f"{CONTROL_FORM}") from None
        return host, port
    if _ipv4(host):
        return host, port
    if _DOTTED.fullmatch(host):
        raise ValueError(f"{what} {text!r}: {host!r} is not an IPv4 address: it must be {CONTROL_FORM}")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in host.split(".")):
        raise ValueError(f"{what} {text!r}: {host[:64]!r} is not a host name (labels of 1-63 letters, digits and "
                         f"'-', not starting or ending with '-'): it must be {CONTROL_FORM}")
    return host, port
