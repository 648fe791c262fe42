"""Who may program the software switch over P4Runtime: client certificates with roles, and the controller's token.

A P4Runtime server with `P4RuntimeAuth` answers only callers it can name (`admit`):
- a client certificate (mutual TLS, `certificates=True`) whose SAN holds the URI
  `urn:luwu:role:controller` or `urn:luwu:role:reader` (`luwu certs issue NAME --role ROLE`);
  its CN names the caller in the audit log;
- or the switch's bearer token in gRPC metadata (`authorization: Bearer <token>`), which grants the
  controller role. With certificates the token is an optional extra; without, it is required.
A wrong token is refused even beside a good certificate (never a silent fallback).

Roles: `controller` may do everything (arbitrate as primary, Write, SetForwardingPipelineConfig);
`reader` may Read, GetForwardingPipelineConfig and open a StreamChannel as a backup that never
becomes primary. Every call needs a credential (the tables name the workers' addresses and
sessions, so reads are authenticated too) but Capabilities, which stays open. Arbitration accepts
only the P4Runtime role the controller uses (`role`, default "": the default full-access role).

The token is per switch: `switch_token(admin_token, name)` (dataplane/p4runtime, shared with the
controller) = HMAC-SHA256 of the switch's name
under the deployment's admin token, so the controller and a `luwu switch --controller` that
registered under that name both know it without the admin token ever reaching a switch's
P4Runtime port.

Transport: with TLS (`server_credentials(cert, key, client_ca)`; a client CA makes it mutual:
the controller must present a certificate that CA signed) the token travels encrypted. Without
TLS the server accepts only loopback peers (gRPC local credentials), because a bearer token in
clear text on a network is no credential; `check_transport` refuses the other combinations.
"""

from __future__ import annotations

import functools
import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

from luwu.dataplane.p4runtime import AUTH_METADATA, CERT_ROLES, CONTROLLER, READER, ROLE_URI_PREFIX, is_loopback

DEFAULT_ROLE = ""  # P4Runtime's default role: full pipeline access


@dataclass(frozen=True)
class Grant:
    """What an admitted caller may do (`role`: controller or reader) and how it is named in audit logs."""

    role: str
    identity: str


def certificate_identity(auth_context) -> tuple[str, str | None] | None:
    """(name, role) from the TLS client certificate of a call's `auth_context()`; None without one.

    name: "CN=<common name>" (else the subject); role: the SAN URI `urn:luwu:role:ROLE`'s ROLE, or
    None when the certificate has none or an unknown one (a CA's other certificates grant nothing).
    """
    pems = (auth_context or {}).get("x509_pem_cert") or []
    if not pems:
        return None
    return _identity(pems[0] if isinstance(pems[0], bytes) else str(pems[0]).encode())


@functools.lru_cache(maxsize=64)  # every call of a connection presents the same certificate
def _identity(pem: bytes) -> tuple[str, str | None]:
    # imported here: only a server that admits client certificates needs `cryptography` (the GPU
    # image of docs/gpu.md runs switches without it)
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = cns[0].value if cns else ""
    cn = cn.decode(errors="replace") if isinstance(cn, bytes) else cn
    name = f"CN={cn}" if cns else (cert.subject.rfc4514_string() or "an unnamed certificate")
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    roles = {u[len(ROLE_URI_PREFIX):] for u in uris if u.startswith(ROLE_URI_PREFIX)} & set(CERT_ROLES)
    # two roles in one certificate: the lesser one (a CA that issued such a thing meant no more)
    role = READER if READER in roles else (CONTROLLER if roles else None)
    return name, role


@dataclass(frozen=True)
class P4RuntimeAuth:
    """Who a P4Runtime server admits.

    Args:
        token: the bearer token that grants the controller role; None: certificates only.
        role: the P4Runtime arbitration role the controller uses ("": the default role).
        certificates: admit callers by their TLS client certificate's role (needs a server with
            a client CA: `server_credentials(cert, key, client_ca)`).

    Example:
        >>> auth = P4RuntimeAuth(None, certificates=True)  # mutual TLS with `luwu certs` roles only
    """

    token: str | None
    role: str = DEFAULT_ROLE
    certificates: bool = False

    def __post_init__(self):
        if self.token is None and not self.certificates:
            raise ValueError("a P4Runtime server needs a token, client certificates with roles, or both")
        if self.token is not None and not self.token.strip():
            raise ValueError("a P4Runtime token must not be empty")

    def admit(self, metadata, auth_context=None) -> Grant | str:
        """The Grant of a call with `metadata` over a connection with `auth_context`; else why it is refused."""
        values = [v for k, v in (metadata or ()) if k == AUTH_METADATA]
        cert = certificate_identity(auth_context) if self.certificates else None
        if values:
            scheme, _, token = str(values[0]).partition(" ")
            if self.token is None:
                return ("this switch takes no bearer token (it admits client certificates with a role only): "
                        "drop the authorization metadata")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.token.encode()):
                return "wrong P4Runtime token for this switch"
            return Grant(CONTROLLER, f"certificate {cert[0]} + bearer token" if cert else "bearer token")
        if cert is not None:
            name, role = cert
            if role is not None:
                return Grant(role, f"certificate {name}")
            return (f"client certificate {name} has no luwu role: issue one with `luwu certs issue NAME --role "
                    f"controller|reader` (SAN URI {ROLE_URI_PREFIX}ROLE)"
                    + (" or send the switch's bearer token" if self.token is not None else ""))
        if self.certificates and self.token is None:
            return ("this switch's P4Runtime admits only clients with a TLS client certificate holding a luwu role "
                    "(`luwu certs issue NAME --role controller|reader`)")
        return ("this switch's P4Runtime needs `authorization: Bearer <token>` metadata"
                + (" or a client certificate with a luwu role" if self.certificates else "")
                + ": only the controller (or a client given the switch's --p4runtime-token-file) may use it")

    def refusal(self, metadata, auth_context=None) -> str | None:
        """None when the call is admitted (`admit`); else why it is refused."""
        grant = self.admit(metadata, auth_context)
        return grant if isinstance(grant, str) else None

    def role_refusal(self, role_name: str) -> str | None:
        if role_name != self.role:
            return (f"role {role_name[:80]!r} is not configured on this switch: only the controller's role "
                    f"{self.role!r} may arbitrate")
        return None


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS for the P4Runtime server; with `client_ca`, clients must present a certificate it signed."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    if client_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=Path(client_ca).read_bytes(),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def check_transport(address: str, auth: P4RuntimeAuth | None, tls: bool, client_ca: bool = False) -> None:
    """Refuse a bearer token offered in clear text beyond loopback, and certificate roles without mutual TLS
    (ValueError saying what to pass)."""
    if auth is not None and auth.certificates and not client_ca:
        raise ValueError("admitting clients by certificate needs mutual TLS: pass --p4runtime-tls-cert, "
                         "--p4runtime-tls-key and --p4runtime-tls-client-ca")
    if auth is not None and not tls and not is_loopback(address):
        raise ValueError(f"P4Runtime on {address} without TLS would carry its token in clear text: serve it on a "
                         "loopback address or pass --p4runtime-tls-cert/--p4runtime-tls-key")


def local_server_credentials() -> grpc.ServerCredentials:
    """Plaintext that only loopback peers may use, and over which clients may send call credentials."""
    return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
