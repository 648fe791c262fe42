"""The software switch: the P4 pipeline of docs/protocol.md section 6, executed with numpy on
batches of packets, attached to UDP sockets (loopback) or network interfaces (raw frames).

    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig, TableError
"""

from .config import ConfigError, SwitchConfig
from .switch import SoftwareSwitch
from .table_schema import SCHEMA, TableError

__all__ = ["SCHEMA", "ConfigError", "SoftwareSwitch", "SwitchConfig", "TableError"]
