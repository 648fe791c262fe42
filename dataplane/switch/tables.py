"""The switch's table store: validated inserts, modifies and deletes of the tables of
docs/protocol.md 6.1 and of multicast groups, as the controller (over P4Runtime), a runtime
JSON file or a test programs them.

Every refusal is a `TableError` naming the table, the field and what is allowed. The pipeline
never reads these dicts directly: it asks for `compiled()`, dense numpy lookups rebuilt only
when the tables changed (`lookup.py`).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator

from ..protocol import MAX_CONTRIBUTORS, MAX_SESSIONS, NODE, NextStep
from .table_schema import (
    INSTANCE_BITS,
    MULTICAST_GROUP_BITS,
    PORT_BITS,
    SCHEMA,
    Field,
    TableError,
    TableSpec,
    find_key,
    parse_value,
    short_name,
    show_value,
    table_spec,
)

Key = tuple  # one int per exact field; (value, prefix_len) for the lpm field


class Tables:
    def __init__(self, slots: int, on_clear: Callable[[], None] | None = None):
        self.slots = slots
        self._on_clear = on_clear
        self._mutex = threading.RLock()  # table mutations vs. the pipeline's snapshot
        self._entries: dict[str, dict[Key, tuple[str, dict[str, int]]]] = {t: {} for t in SCHEMA}
        self._defaults: dict[str, tuple[str, dict[str, int]]] = {}
        self._groups: dict[int, list[tuple[int, int]]] = {}
        self.version = 0  # bumped on every change; the pipeline recompiles its lookups when it moves
        self._compiled = None

    # -- entries -----------------------------------------------------------------------------
    def insert(self, table: str, match: dict, action: str, params: dict | None = None, modify: bool = False) -> None:
        spec = table_spec(table)
        key = self._key(spec, match)
        act, values = self._action(spec, action, params or {})
        self._check_semantics(spec, key, act, values)
        with self._mutex:
            rows = self._entries[spec.name]
            if modify and key not in rows:
                raise TableError(f"table {spec.name!r}: no entry for {self._show_key(spec, key)} to modify "
                                 f"(insert it first)")
            if not modify and key in rows:
                raise TableError(f"table {spec.name!r}: an entry for {self._show_key(spec, key)} already exists "
                                 f"(pass modify=True to change it)")
            if not modify and len(rows) >= spec.size:
                raise TableError(f"table {spec.name!r} is full ({spec.size} entries): delete entries first")
            rows[key] = (act, values)
            self._changed()

    def delete(self, table: str, match: dict) -> None:
        spec = table_spec(table)
        key = self._key(spec, match)
        with self._mutex:
            rows = self._entries[spec.name]
            if key not in rows:
                raise TableError(f"table {spec.name!r}: no entry for {self._show_key(spec, key)} to delete")
            del rows[key]
            self._changed()

    def entries(self, table: str) -> list[dict]:
        spec = table_spec(table)
        with self._mutex:
            items = list(self._entries[spec.name].items())
        out = []
        for key, (act, values) in items:
            match = {}
            for f, v in zip(spec.keys, key):
                match[f.name] = tuple(v) if f.kind == "lpm" else v
            out.append({"match": match, "action": act, "params": dict(values)})
        return out

    def lookup(self, table: str, match: dict) -> dict | None:
        """The entry with exactly this match (not a longest-prefix search), or None."""
        spec = table_spec(table)
        key = self._key(spec, match)
        with self._mutex:
            hit = self._entries[spec.name].get(key)
        return None if hit is None else {"action": hit[0], "params": dict(hit[1])}

    def set_default(self, table: str, action: str, params: dict | None = None) -> None:
        """The action of a table miss. Only ipv4_lpm has a choice (a default route); on every other
        table a miss is the drop the spec names, so only NoAction/drop are accepted there."""
        spec = table_spec(table)
        name = short_name(action)
        if name not in spec.default_actions:
            raise TableError(f"table {spec.name!r}: default action {action!r} not supported; allowed: "
                             f"{', '.join(spec.default_actions)}")
        if name in spec.actions:
            act, values = self._action(spec, name, params or {})
        elif params:
            raise TableError(f"table {spec.name!r}: default action {name} takes no params, got {sorted(params)}")
        else:
            act, values = name, {}
        self._check_semantics(spec, None, act, values)
        with self._mutex:
            self._defaults[spec.name] = (act, values)
            self._changed()

    def default(self, table: str) -> tuple[str, dict[str, int]]:
        spec = table_spec(table)
        with self._mutex:
            return self._defaults.get(spec.name, ("NoAction", {}))

    # -- multicast groups --------------------------------------------------------------------
    def set_multicast_group(self, group_id: int, replicas: list[tuple[int, int]]) -> None:
        gid = self._group_id(group_id)
        seen: set[tuple[int, int]] = set()
        clean: list[tuple[int, int]] = []
        for i, rep in enumerate(replicas):
            try:
                port, instance = rep
            except (TypeError, ValueError):
                raise TableError(f"multicast group {gid}: replica {i} must be (egress_port, instance), "
                                 f"got {rep!r}") from None
            where = f"multicast group {gid} replica {i}"
            port = parse_value(port, Field("egress_port", PORT_BITS), where)
            instance = parse_value(instance, Field("instance", INSTANCE_BITS), where)
            if (port, instance) in seen:
                raise TableError(f"{where}: duplicate replica (egress_port {port}, instance {instance})")
            seen.add((port, instance))
            clean.append((port, instance))
        with self._mutex:
            self._groups[gid] = clean
            self._changed()

    def delete_multicast_group(self, group_id: int) -> None:
        gid = self._group_id(group_id)
        with self._mutex:
            if gid not in self._groups:
                raise TableError(f"multicast group {gid} does not exist (groups: {sorted(self._groups) or 'none'})")
            del self._groups[gid]
            self._changed()

    def multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        with self._mutex:
            return {g: list(r) for g, r in self._groups.items()}

    def clear(self) -> None:
        """A new pipeline config: every entry, default action and multicast group goes (and, like a
        P4 target loading a program, the registers are reset through `on_clear`)."""
        self.clear_entries()
        if self._on_clear is not None:
            self._on_clear()

    def clear_entries(self) -> None:
        """Every entry, default and group goes; registers are kept (unlike `clear`)."""
        with self._mutex:
            for rows in self._entries.values():
                rows.clear()
            self._defaults.clear()
            self._groups.clear()
            self._changed()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """All changes inside take effect together, or (on an exception) not at all."""
        with self._mutex:
            saved = copy.deepcopy((self._entries, self._defaults, self._groups))
            try:
                yield
            except BaseException:
                self._entries, self._defaults, self._groups = saved
                self._changed()
                raise

    # -- the pipeline's view -----------------------------------------------------------------
    def compiled(self):
        """Dense lookups for the current contents (cached until the next change)."""
        done = self._compiled  # (every turn asks: the current one without the lock or the import)
        if done is not None and done.version == self.version:
            return done
        from .lookup import CompiledTables

        with self._mutex:
            if self._compiled is None or self._compiled.version != self.version:
                self._compiled = CompiledTables(self.version, {t: dict(r) for t, r in self._entries.items()},
                                                dict(self._defaults), {g: list(r) for g, r in self._groups.items()})
            return self._compiled

    # -- validation --------------------------------------------------------------------------
    def _changed(self) -> None:
        self.version += 1

    @staticmethod
    def _group_id(group_id) -> int:
        gid = parse_value(group_id, Field("multicast_group_id", MULTICAST_GROUP_BITS), "multicast group")
        if gid == 0:
            raise TableError("multicast group id 0 is reserved (no multicast); use 1..65535")
        return gid

    @staticmethod
    def _key(spec: TableSpec, match: dict) -> Key:
        if not isinstance(match, dict):
            raise TableError(f"table {spec.name!r}: match must be a dict like "
                             f"{{{', '.join(repr(k.name) + ': ...' for k in spec.keys)}}}, got {match!r}")
        values: dict[str, int | tuple[int, int]] = {}
        for given, raw in match.items():
            f = find_key(spec, given)
            if f.name in values:
                raise TableError(f"table {spec.name!r}: match field {f.name!r} given twice")
            where = f"table {spec.name!r}"
            if f.kind == "lpm":
                values[f.name] = _lpm_value(raw, f, where)
            else:
                values[f.name] = parse_value(raw, f, where)
        missing = [k.name for k in spec.keys if k.name not in values]
        if missing:
            raise TableError(f"table {spec.name!r}: match is missing {', '.join(missing)} (key: "
                             f"{', '.join(spec.key_names())})")
        return tuple(values[k.name] for k in spec.keys)

    @staticmethod
    def _action(spec: TableSpec, action: str, params: dict) -> tuple[str, dict[str, int]]:
        name = short_name(action)
        if name not in spec.actions:
            raise TableError(f"table {spec.name!r}: unknown action {action!r}; allowed: {', '.join(spec.actions)}")
        fields = spec.actions[name]
        if not isinstance(params, dict):
            raise TableError(f"table {spec.name!r} action {name}: params must be a dict, got {params!r}")
        given = {short_name(k): v for k, v in params.items()}
        expected = [f.name for f in fields]
        missing = [n for n in expected if n not in given]
        extra = [n for n in given if n not in expected]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if extra:
                parts.append(f"unexpected {', '.join(extra)}")
            raise TableError(f"table {spec.name!r} action {name}: {'; '.join(parts)} (params: "
                             f"{', '.join(f'{f.name}:{f.bits}' for f in fields) or 'none'})")
        where = f"table {spec.name!r} action {name}"
        return name, {f.name: parse_value(given[f.name], f, where) for f in fields}

    def _check_semantics(self, spec: TableSpec, key: Key | None, action: str, p: dict[str, int]) -> None:
        where = f"table {spec.name!r}"
        if key is not None and "session" in spec.key_names():
            session = key[spec.key_names().index("session")]
            if not 1 <= session < MAX_SESSIONS:
                raise TableError(f"{where}: session {session} out of range 1..{MAX_SESSIONS - 1}")
        if action == "set_session":
            size, base = p["pool_size"], p["pool_base"]
            if size & (size - 1):  # 0 is allowed: no slots here, every GRAD falls back (protocol.md 4)
                raise TableError(f"{where} action set_session: pool_size {size} must be a power of two, or 0 "
                                 f"for a session without slots on this switch (every GRAD falls back)")
            if base + size > self.slots:
                raise TableError(f"{where} action set_session: pool [{base}, {base + size}) must lie inside "
                                 f"[0, {self.slots}) (the switch has {self.slots} slots per set)")
            if not 1 <= p["num_workers"] <= MAX_CONTRIBUTORS:
                raise TableError(f"{where} action set_session: num_workers {p['num_workers']} must be "
                                 f"1..{MAX_CONTRIBUTORS}")
            if bin(p["worker_mask"]).count("1") != p["num_workers"]:
                raise TableError(f"{where} action set_session: worker_mask {p['worker_mask']:#x} has "
                                 f"{bin(p['worker_mask']).count('1')} bits but num_workers is {p['num_workers']} "
                                 f"(the mask is the OR of the session's worker_bits)")
            if p["next_step"] not in (int(NextStep.ROOT), int(NextStep.UPSTREAM)):
                raise TableError(f"{where} action set_session: next_step {p['next_step']} must be "
                                 f"{int(NextStep.ROOT)} (ROOT) or {int(NextStep.UPSTREAM)} (UPSTREAM)")
        elif action == "set_worker":
            bit = p["worker_bit"]
            if bit == 0 or bit & (bit - 1):
                raise TableError(f"{where} action set_worker: worker_bit {bit:#x} must be exactly one bit "
                                 f"(1 << local index)")
            if key is not None and key[1] == NODE:
                raise TableError(f"{where}: worker {NODE:#x} is the node/parent, not a contributor; "
                                 f"use a rank 0..{NODE - 1}")

    @staticmethod
    def _show_key(spec: TableSpec, key: Key) -> str:
        parts = []
        for f, v in zip(spec.keys, key):
            parts.append(f"{f.name}={show_value(v[0], f)}/{v[1]}" if f.kind == "lpm" else f"{f.name}={show_value(v, f)}")
        return "{" + ", ".join(parts) + "}"


def _lpm_value(raw, f: Field, where: str) -> tuple[int, int]:
    if isinstance(raw, str) and "/" in raw:
        addr, _, plen = raw.partition("/")
        raw = (addr, plen)
    if not isinstance(raw, (tuple, list)) or len(raw) != 2:
        raise TableError(f"{where}: lpm field {f.name} needs (address, prefix_len), e.g. ('10.0.0.0', 8); "
                         f"got {raw!r}")
    value = parse_value(raw[0], f, where)
    try:
        plen = int(raw[1])
    except (TypeError, ValueError):
        raise TableError(f"{where}: {f.name} prefix length {raw[1]!r} is not a number") from None
    if not 0 <= plen <= f.bits:
        raise TableError(f"{where}: {f.name} prefix length {plen} out of range 0..{f.bits}")
    mask = ((1 << plen) - 1) << (f.bits - plen)
    if value & ~mask & f.max:
        raise TableError(f"{where}: {f.name} {show_value(value, f)}/{plen} has bits set outside the prefix; "
                         f"use {show_value(value & mask, f)}/{plen}")
    return value, plen
