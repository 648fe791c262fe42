"""Where the P4Runtime spec leaves the software switch a choice, the answer BMv2 (PI) gives, so that
clients written against BMv2 (finsy, p4runtime-shell) see the same behaviour here.

- A MODIFY of a table's default entry with no action restores the P4 program's initial default
  action (P4Info `initial_default_action`, else NoAction): finsy's `delete_all()` resets every
  default entry this way.
- A multicast group written with the deprecated `Replica.egress_port` (p4runtime-shell, clients
  of P4Runtime before 1.4) reads back in that field; one written with `Replica.port` reads back
  in `port`.
- Errors name the section of the P4Runtime specification that a refused request breaks
  (`spec(section)`), so that a user can look the rule up.
"""

from __future__ import annotations

from finsy.p4values import encode_exact
from finsy.proto import p4r

SPEC = "P4Runtime spec"
DEFAULT_ENTRY = "TableEntry: Default Entry"
TABLE_WRITE = "TableEntry: Write semantics (INSERT/MODIFY/DELETE)"
MULTICAST = "PacketReplicationEngineEntry: MulticastGroupEntry"
IDS = "P4Info: ids of tables, actions and params"


def spec(section: str) -> str:
    """` (P4Runtime spec: SECTION)`, to end an error message with."""
    return f" ({SPEC}: {section})"


def initial_default(schema, table) -> tuple[str, dict[str, int]]:
    """(action alias, {param name: value}) of `table`'s initial default action in the P4Info of
    finsy `schema` (NoAction when the P4Info names none)."""
    ida = table.pbuf.initial_default_action
    if not ida.action_id:
        return "NoAction", {}
    action = schema.actions[ida.action_id]
    return action.alias, {action.params[a.param_id].name: int.from_bytes(a.value, "big") for a in ida.arguments}


def uses_egress_port(group: p4r.MulticastGroupEntry) -> bool:
    """True when the group's replicas name their ports in the deprecated `egress_port` field."""
    return any(r.WhichOneof("port_kind") == "egress_port" for r in group.replicas)


def encode_replicas(pairs, deprecated: bool) -> list[p4r.Replica]:
    """Replicas (port, instance) in the field the client wrote them in."""
    if deprecated:
        return [p4r.Replica(egress_port=port, instance=inst) for port, inst in pairs]
    return [p4r.Replica(port=encode_exact(port, 32), instance=inst) for port, inst in pairs]
