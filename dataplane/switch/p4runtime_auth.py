"""Who may program the software switch over P4Runtime: the controller's role and credential.

A P4Runtime server with `P4RuntimeAuth` answers only callers that present its bearer token in
gRPC metadata (`authorization: Bearer <token>`): StreamChannel (so nobody else can become
primary), Write and SetForwardingPipelineConfig (which also need the primary's election id),
Read and GetForwardingPipelineConfig (the tables name the workers' addresses and sessions, so
reads are authenticated too). Capabilities stays open. Arbitration accepts only the role the
controller uses (`role`, default "": P4Runtime's default full-access role).

The token is per switch: `switch_token(admin_token, name)` = HMAC-SHA256 of the switch's name
under the deployment's admin token, so the controller and a `luwu switch --controller` that
registered under that name both know it without the admin token ever reaching a switch's
P4Runtime port.

Transport: with TLS (`server_credentials(cert, key, client_ca)`; a client CA makes it mutual:
the controller must present a certificate that CA signed) the token travels encrypted. Without
TLS the server accepts only loopback peers (gRPC local credentials), because a bearer token in
clear text on a network is no credential; `check_transport` refuses the other combinations.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

AUTH_METADATA = "authorization"
DEFAULT_ROLE = ""  # P4Runtime's default role: full pipeline access
_DERIVATION = b"luwu p4runtime writer v1:"


def switch_token(admin_token: str, switch_name: str) -> str:
    """The P4Runtime credential of switch `switch_name` in the deployment of `admin_token`.

    Args:
        admin_token: the deployment's admin token (the controller's `--token-file`).
        switch_name: the name the switch registers under.

    Returns:
        64 hex characters; the same on the controller and on the switch.
    """
    if not admin_token:
        raise ValueError("deriving a switch's P4Runtime token needs the deployment's admin token")
    return hmac.new(admin_token.encode(), _DERIVATION + switch_name.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class P4RuntimeAuth:
    token: str
    role: str = DEFAULT_ROLE

    def __post_init__(self):
        if not self.token or not self.token.strip():
            raise ValueError("a P4Runtime token must not be empty")

    def refusal(self, metadata) -> str | None:
        """None when `metadata` carries this token; else why the call is refused."""
        values = [v for k, v in (metadata or ()) if k == AUTH_METADATA]
        if not values:
            return ("this switch's P4Runtime needs `authorization: Bearer <token>` metadata: only the controller "
                    "(or a client given the switch's --p4runtime-token-file) may use it")
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            return "wrong P4Runtime token for this switch"
        return None

    def role_refusal(self, role_name: str) -> str | None:
        if role_name != self.role:
            return (f"role {role_name[:80]!r} is not configured on this switch: only the controller's role "
                    f"{self.role!r} may arbitrate")
        return None


def is_loopback(address: str) -> bool:
    """True for HOST:PORT on a loopback host (127.0.0.0/8, ::1, localhost)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS for the P4Runtime server; with `client_ca`, clients must present a certificate it signed."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    if client_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=Path(client_ca).read_bytes(),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def check_transport(address: str, auth: P4RuntimeAuth | None, tls: bool) -> None:
    """Refuse a bearer token offered in clear text beyond loopback (ValueError saying what to pass)."""
    if auth is not None and not tls and not is_loopback(address):
        raise ValueError(f"P4Runtime on {address} without TLS would carry its token in clear text: serve it on a "
                         "loopback address or pass --p4runtime-tls-cert/--p4runtime-tls-key")


def local_server_credentials() -> grpc.ServerCredentials:
    """Plaintext that only loopback peers may use, and over which clients may send call credentials."""
    return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
