"""Who may call what: the deployment's admin token, or a job's own token for that job only.

Clients send gRPC metadata `authorization: Bearer <token>`. The admin token (config, env or a
file) may do everything; the token CreateJob returns may call JoinJob / EndJob / GetPlan /
GetJob / WatchJob for its own job and nothing else. Tokens are compared in constant time, and
job tokens are stored only as SHA-256 hashes.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

import grpc

from .store import token_hash

TOKEN_BYTES = 32  # entropy of generated tokens
JOB_SCOPED = ("JoinJob", "EndJob", "GetPlan", "GetJob", "WatchJob", "GetTop")


class AuthError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Caller:
    admin: bool
    token: str


def new_token() -> str:
    """A url-safe random token that never starts with '-' (one in 64 would, and `luwu-ctl --token
    -x...` then reads it as an option); the redraw keeps every token uniform over the rest."""
    while True:
        token = secrets.token_urlsafe(TOKEN_BYTES)
        if not token.startswith("-"):
            return token


class Authenticator:
    def __init__(self, admin_token: str):
        if not admin_token:
            raise ValueError("the controller needs an admin token: pass --token-file FILE or set LUWU_TOKEN")
        self._admin = admin_token
        self.refusals: dict[tuple[str, str], int] = {}  # (method, status code name) -> calls refused

    def refused(self, method: str, code: grpc.StatusCode) -> None:
        """Count a refusal (the controller's metrics export it as luwu_controller_auth_refusals_total)."""
        key = (method, code.name)
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def caller(self, metadata) -> Caller:
        """Who is calling, from the invocation metadata; AuthError(UNAUTHENTICATED) if nobody."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "missing `authorization: Bearer <token>` metadata: pass "
                                                             "--token / LUWU_TOKEN (or the job token)")
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "malformed authorization metadata: expected "
                                                             "`Bearer <token>`")
        token = token.strip()
        return Caller(hmac.compare_digest(token.encode(), self._admin.encode()), token)

    def require_admin(self, caller: Caller, method: str) -> None:
        if not caller.admin:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED, f"{method} needs the deployment's admin token "
                                                               "(a job token only reaches its own job)")

    def require_job(self, caller: Caller, method: str, job_token_sha256: str) -> None:
        """Admin, or the token of this very job."""
        if caller.admin:
            return
        if method not in JOB_SCOPED:
            self.require_admin(caller, method)
        if not hmac.compare_digest(token_hash(caller.token), job_token_sha256):
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED, f"{method}: this token belongs to another job (or to "
                                                               "none): use the token CreateJob returned for this job")
