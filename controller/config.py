"""The controller's settings with their documented defaults (flags of `luwu controller` override them).

Every size, timeout and address the controller uses comes from here; nothing is buried in code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from luwu.dataplane.process.usage import UserError

DEFAULT_LISTEN = "127.0.0.1:50100"  # the controller's gRPC address (P4Runtime servers start at 50051)
CONTROLLER_ENV = "LUWU_CONTROLLER"  # clients: where the controller is
TOKEN_ENV = "LUWU_TOKEN"  # clients and server: the admin token
DEFAULT_DB = Path.home() / ".luwu" / "controller.sqlite"


@dataclass
class ControllerConfig:
    listen: str = DEFAULT_LISTEN
    db: str = str(DEFAULT_DB)
    admin_token: str = ""  # empty: read from --token-file / LUWU_TOKEN; required to start
    tls_cert: str = ""  # PEM files; both set -> the server listens with TLS
    tls_key: str = ""
    health_timeout: float = 15.0  # seconds without a heartbeat before a switch / node is "down"
    health_check_interval: float = 1.0  # how often the monitor looks
    # -- planning --
    meta_pool: int = 32  # slots of a job's `meta` collective session (per-chunk exponents)
    data_pool: int = 256  # slots of a job's `data` collective session
    node_pool: int = 256  # slots of each node session
    min_pool: int = 16  # when a switch is full, pools shrink by halves down to this size ...
    allow_fallback: bool = True  # ... then node sessions fall back to the node (pool size 0, ATP-style)
    param_window: int = 256  # PARAM stream window (packets) of node sessions
    min_shard: int = 4096  # never cut a layer into slices smaller than this (elements)
    # -- switch programming --
    p4info: str = ""  # P4Info text file; empty: the committed luwu.p4.P4INFO_TXTPB
    bmv2_json: str = ""  # BMv2 device config for targets "bmv2"; empty: p4/build/luwu_v1model.json
    program_timeout: float = 20.0  # seconds for connecting to and programming one switch
    device_config_marker: str = "luwu-software-switch"  # device config sent to software switches
    switch_tls_ca: str = ""  # PEM CA of the switches' P4Runtime certificates; empty: loopback plaintext
    switch_tls_cert: str = ""  # PEM client certificate for switches that require one (mutual TLS)
    switch_tls_key: str = ""
    reconcile_interval: float = 10.0  # seconds between read-backs of every switch (drift repair); 0: off
    metrics: str = ""  # HOST:PORT to serve Prometheus /metrics on ("": none); port 0 picks one
    audit_log: str = ""  # JSON-lines file of every P4Runtime write to a switch ("": none; dataplane/p4runtime/audit.py)

    def validate(self) -> None:
        for name in ("meta_pool", "data_pool", "node_pool", "min_pool"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.health_timeout <= 0:
            raise ValueError(f"--health-timeout must be positive, got {self.health_timeout}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if bool(self.switch_tls_cert) != bool(self.switch_tls_key):
            raise ValueError("a client certificate for switches needs both --switch-tls-cert and --switch-tls-key")
        if self.switch_tls_cert and not self.switch_tls_ca:
            raise ValueError("--switch-tls-cert needs --switch-tls-ca (the CA that signed the switches' certificates)")
        if self.reconcile_interval < 0:
            raise ValueError(f"--reconcile-interval must be >= 0 seconds (0: off), got {self.reconcile_interval}")

    def p4info_path(self) -> Path:
        if self.p4info:
            return Path(self.p4info)
        from luwu.dataplane.p4runtime import P4INFO_TXTPB

        return Path(P4INFO_TXTPB)

    def bmv2_json_path(self) -> Path:
        if self.bmv2_json:
            return Path(self.bmv2_json)
        from luwu.dataplane.p4runtime import BUILD_DIR

        return Path(BUILD_DIR) / "luwu_v1model.json"


def read_token(token: str = "", token_file: str = "", env: str = TOKEN_ENV) -> str:
    """A token from the argument, else the file, else the environment; '' when none."""
    if token:
        return token.strip()
    if token_file:
        path = Path(token_file).expanduser()
        try:
            return path.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"token file {path}: cannot read it ({getattr(e, 'strerror', None) or e}); write the "
                            "deployment's token into it") from None
    return os.environ.get(env, "").strip()
