"""How the controller authenticates to a switch's P4Runtime: the switch's token, over TLS or loopback.

Every call carries `authorization: Bearer <switch_token(admin token, switch name)>` (see
`luwu.dataplane.p4runtime`). gRPC sends call credentials only over a protected
channel, so the token rides on TLS when the deployment configures it (`--switch-tls-ca`, plus
`--switch-tls-cert/--switch-tls-key` for switches that require a client certificate), else on
gRPC local credentials when the switch is on loopback. A switch beyond loopback without TLS gets
no token (BMv2 has no authentication to give it to; a `luwu switch` refuses to serve that way).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from finsy.grpcutil import GRPCCredentialsTLS

from . import AUTH_METADATA, is_loopback


@dataclass(frozen=True)
class SwitchTls:
    ca: str  # PEM: the CA that signed the switches' certificates
    cert: str = ""  # PEM: the controller's client certificate (mutual TLS)
    key: str = ""


class _Bearer(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._metadata = ((AUTH_METADATA, f"Bearer {token}"),)

    def __call__(self, context, callback):
        callback(self._metadata, None)


@dataclass(kw_only=True)
class _LocalWithToken(GRPCCredentialsTLS):
    """finsy's credentials hook, but over gRPC local (loopback) credentials instead of TLS."""

    def to_client_credentials(self) -> grpc.ChannelCredentials:
        return self._compose_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP))


def switch_credentials(address: str, token: str, tls: SwitchTls | None) -> GRPCCredentialsTLS | None:
    """finsy channel credentials for the switch at `address` (None: plaintext without a token)."""
    plugin = _Bearer(token) if token else None
    if tls is not None:
        return GRPCCredentialsTLS(cacert=Path(tls.ca), cert=Path(tls.cert) if tls.cert else None,
                                  private_key=Path(tls.key) if tls.key else None, call_credentials=plugin)
    if plugin is not None and is_loopback(address):
        return _LocalWithToken(cacert=None, cert=None, private_key=None, call_credentials=plugin)
    return None
