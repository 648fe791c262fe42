"""The controller's durable state in sqlite: registrations, jobs with their plans, events, counters.

Everything a restarted controller needs to resume is here: switches and nodes (as their
registration messages), jobs (spec, plan, state, joined ranks, a hash of the job token),
job events (for WatchJob replays) and the epoch and job counters, which only ever grow, so
an epoch is never handed out twice. Each change is one committed transaction.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from luwu.proto import controller_pb2 as pb

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS switches (name TEXT PRIMARY KEY, record BLOB NOT NULL, registered REAL NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (name TEXT PRIMARY KEY, record BLOB NOT NULL, drained INTEGER NOT NULL DEFAULT 0,
                                  registered REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, plan TEXT NOT NULL,
                                 state INTEGER NOT NULL, token_sha256 TEXT NOT NULL, created REAL NOT NULL,
                                 joined TEXT NOT NULL DEFAULT '{}', ended REAL);
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, time REAL NOT NULL,
                                   kind TEXT NOT NULL, subject TEXT NOT NULL, message TEXT NOT NULL);
"""
EPOCH_LIMIT = 2**32  # epochs are 32-bit on the wire (docs/protocol.md 6.1)


@dataclass
class JobRow:
    job_id: str
    name: str
    spec: dict
    plan: str  # JobPlan JSON
    state: pb.JobState  # stored as its number
    token_sha256: str
    created: float
    joined: dict[int, str] = field(default_factory=dict)  # rank -> endpoint address
    ended: float | None = None


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class StateStore:
    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # an epoch must survive a crash once handed out
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- counters -------------------------------------------------------------------------------
    def _bump(self, key: str, limit: int | None = None) -> int:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            value = (row[0] if row else 0) + 1
            if limit is not None and value >= limit:
                raise RuntimeError(f"{key} exhausted ({limit}): start a new deployment database")
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        return value

    def next_epoch(self) -> int:
        return self._bump("epoch", EPOCH_LIMIT)

    def next_job_number(self) -> int:
        return self._bump("job")

    def counter(self, key: str) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else 0

    # -- registrations --------------------------------------------------------------------------
    def put_switch(self, name: str, record: bytes) -> None:
        self.db.execute("INSERT OR REPLACE INTO switches (name, record, registered) VALUES (?, ?, ?)",
                        (name, record, time.time()))

    def delete_switch(self, name: str) -> bool:
        return self.db.execute("DELETE FROM switches WHERE name = ?", (name,)).rowcount > 0

    def switches(self) -> dict[str, bytes]:
        return dict(self.db.execute("SELECT name, record FROM switches ORDER BY name"))

    def put_node(self, name: str, record: bytes) -> None:
        drained = self.db.execute("SELECT drained FROM nodes WHERE name = ?", (name,)).fetchone()
        self.db.execute("INSERT OR REPLACE INTO nodes (name, record, drained, registered) VALUES (?, ?, ?, ?)",
                        (name, record, drained[0] if drained else 0, time.time()))

    def delete_node(self, name: str) -> bool:
        return self.db.execute("DELETE FROM nodes WHERE name = ?", (name,)).rowcount > 0

    def nodes(self) -> dict[str, tuple[bytes, bool]]:
        return {n: (r, bool(d)) for n, r, d in self.db.execute("SELECT name, record, drained FROM nodes ORDER BY name")}

    def set_drained(self, name: str, drained: bool = True) -> None:
        self.db.execute("UPDATE nodes SET drained = ? WHERE name = ?", (int(drained), name))

    # -- jobs -----------------------------------------------------------------------------------
    def put_job(self, row: JobRow) -> None:
        self.db.execute("INSERT OR REPLACE INTO jobs (job_id, name, spec, plan, state, token_sha256, created, joined, "
                        "ended) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (row.job_id, row.name, json.dumps(row.spec), row.plan, row.state, row.token_sha256,
                         row.created, json.dumps({str(k): v for k, v in row.joined.items()}), row.ended))

    def job(self, job_id: str) -> JobRow | None:
        rows = self._jobs("WHERE job_id = ?", (job_id,))
        return rows[0] if rows else None

    def jobs(self, include_ended: bool = True) -> list[JobRow]:
        return self._jobs("" if include_ended else "WHERE ended IS NULL", ())

    def _jobs(self, where: str, args: tuple) -> list[JobRow]:
        out = []
        for r in self.db.execute(f"SELECT job_id, name, spec, plan, state, token_sha256, created, joined, ended "
                                 f"FROM jobs {where} ORDER BY created, job_id", args):
            out.append(JobRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5], r[6],
                              {int(k): v for k, v in json.loads(r[7]).items()}, r[8]))
        return out

    # -- events ---------------------------------------------------------------------------------
    def add_event(self, job_id: str, kind: str, subject: str, message: str) -> tuple[int, float]:
        now = time.time()
        cur = self.db.execute("INSERT INTO events (job_id, time, kind, subject, message) VALUES (?, ?, ?, ?, ?)",
                              (job_id, now, kind, subject, message))
        if cur.lastrowid is None:  # sqlite sets it on every successful INSERT; never hand out a made-up id
            raise RuntimeError("sqlite gave no row id for an inserted event")
        return cur.lastrowid, now

    def events(self, job_id: str) -> list[tuple[int, float, str, str, str]]:
        return list(self.db.execute("SELECT seq, time, kind, subject, message FROM events WHERE job_id = ? "
                                    "ORDER BY seq", (job_id,)))
