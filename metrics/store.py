# Over 400 lines: the SQLite schema, its migration and every query sit together so the schema has one home.
"""The metrics store: one SQLite file holding every run's requests, token times, engine
steps and routing decisions, so runs can be compared by run id long after they ended.

Why SQLite (stdlib `sqlite3`): it is embedded (no server to start next to Ray), in the
standard library, a single file that can be copied next to a plot, transactional, and fine
with one writer. The store has exactly one writer: the `StoreActor` (cluster/store_actor.py)
that replicas, router and driver send batches to. WAL mode lets `slotserve report` read the
file while a run is still writing it, and a process killed mid-batch leaves the file valid
with every committed batch intact (WAL with synchronous=NORMAL loses nothing on a process
crash; only a power cut can drop the last commits).

Each `add_*` call writes its batch in one transaction: a writer killed in the middle leaves
either the whole batch or none of it. Rows are dicts keyed by column name; an unknown key is
an error naming it, so a renamed field cannot silently turn into NULLs. JSON columns take a
dict (or its JSON text) and read back as a dict.

Schema (see `SCHEMA`; times are seconds on the writer's clock, `time.time()` in the cluster):

- runs: one row per run. `status` is 'running' from `begin_run` until `end_run` writes the
  final one ('complete', 'failed' or 'aborted'). The store cannot tell a run still in
  progress from one whose driver died (SIGKILL, Ctrl-C) before `end_run`: both keep
  'running' and `ended` NULL. Reads add `complete` (True only after
  `end_run(status='complete')`); analyses treat every other run as incomplete.
  `config`, `slo` and `machine` are JSON objects.
- requests: one row per request at its final event, client-side times: `arrival` (what
  TTFT/E2E are measured from), `planned_arrival` (the workload's schedule) and
  `submit_lateness` (how late the driver submitted it), `first_token`, `completion`.
  `replica_id` is NULL for a request rejected before it reached a replica; `cached_tokens` is
  what its replica's prefix cache held of its prompt when it admitted it (NULL: not known).
- tokens: every output token's client-side arrival time, `idx` from 0.
- steps: one row per engine step of a replica (replica clock): its replica and slots, then
  every field of `protocol.records.StepRecord` under the field's name (what
  `slotserve calibrate --from-store` fits a cost model to).
- decisions: one row per routing decision, the fields of `protocol.records.Decision` (scores
  and in-flight counts as JSON objects keyed by replica id).

The steps and decisions tables are derived from those record types (`record_columns`): a field
of the record is a column of the same name, its SQL type from the field's type. Only a row's
key (the replica and step, the request) is NOT NULL, so a store migrated from an older schema
keeps its old rows, NULL where a field did not exist yet.
- migrations: one row per move of a request off a replica that was lost or drained, or that
  handed it over (prefill/decode disaggregation): from, to (NULL when no replica could take
  it), the tokens carried over, why, and the K/V bytes fetched with it and the fetch's time.
- scaling: one row per autoscaling decision, the fields of `protocol.scaling.ScalingDecision`
  (its inputs as a JSON object); cold_starts: one row per replica the autoscaler started, the
  fields of `protocol.scaling.ColdStart`. Both derived from their records, like steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import time
import types
import typing
from pathlib import Path

from metrics.definitions import RequestTrace
from protocol import defaults
from protocol.cpu import cpu_info
from protocol.errors import SlotServeError
from protocol.records import Decision, StepRecord
from protocol.scaling import ColdStart, ScalingDecision

DEFAULT_STORE = Path("results/slotserve.db")
SCHEMA_VERSION = 8
_MIGRATIONS_TABLE = """CREATE TABLE IF NOT EXISTS migrations (
    run_id INTEGER NOT NULL REFERENCES runs(run_id),
    request_id TEXT NOT NULL,
    time REAL,
    from_replica TEXT NOT NULL,
    to_replica TEXT,                 -- NULL: no replica could take it (the request failed)
    tokens_carried INTEGER,          -- tokens already delivered, prefilled on the new replica
    reason TEXT,
    kv_bytes INTEGER,                -- K/V taken from the old replica instead (a hand-over); 0: computed
    kv_seconds REAL                  -- the K/V fetch's time; NULL: none was tried
);"""
# How a store of an older version is brought up to this one, step by step (version -> SQL
# statements): version 3 named four step columns apart from StepRecord's fields.
_MIGRATIONS = {
    1: ["ALTER TABLE steps ADD COLUMN context_tokens INTEGER"],
    2: [_MIGRATIONS_TABLE],
    3: [
        f"ALTER TABLE steps RENAME COLUMN {old} TO {new}"
        for old, new in [
            ("time", "start"),
            ("decode_tokens", "num_decode_tokens"),
            ("prefill_tokens", "num_prefill_tokens"),
            ("preemptions", "num_preemptions"),
        ]
    ],
}
END_STATUSES = ("complete", "failed", "aborted")


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    sql: str  # SQLite type
    required: bool  # NOT NULL, and a batch row must carry it
    json: bool = False  # a dict, stored as JSON text

    @property
    def ddl(self) -> str:
        return f"{self.name} {self.sql}{' NOT NULL' if self.required else ''}"


_SQL_TYPES = {int: "INTEGER", float: "REAL", str: "TEXT", bool: "INTEGER", dict: "TEXT"}


def record_columns(record_type: type, keys: tuple[str, ...] = ()) -> tuple[Column, ...]:
    """A record dataclass's fields as columns: same names and order, the SQL type of each
    field's type (a dict is JSON text, `X | None` is X's type); the `keys` are required."""
    hints = typing.get_type_hints(record_type)
    columns = []
    for f in dataclasses.fields(record_type):
        kind, members = hints[f.name], typing.get_args(hints[f.name])
        if isinstance(kind, types.UnionType) and type(None) in members:
            [kind] = [m for m in members if m is not type(None)]
        base = typing.get_origin(kind) or kind
        if base not in _SQL_TYPES:
            raise TypeError(f"{record_type.__name__}.{f.name}: no SQL type for {kind}")
        columns.append(Column(f.name, _SQL_TYPES[base], f.name in keys, json=base is dict))
    return tuple(columns)


# The tables written from records: what a row carries beside the record, then its fields.
_RECORD_TABLES = {
    "steps": (
        Column("replica_id", "TEXT", True),
        Column("num_slots", "INTEGER", False),
        *record_columns(StepRecord, keys=("step",)),
    ),
    "decisions": record_columns(Decision, keys=("request_id",)),
    "scaling": record_columns(ScalingDecision, keys=("time",)),
    "cold_starts": record_columns(ColdStart, keys=("replica_id",)),
}


def _record_table(name: str) -> str:
    columns = ",\n    ".join(c.ddl for c in _RECORD_TABLES[name])
    return (
        f"CREATE TABLE IF NOT EXISTS {name} (\n    run_id INTEGER NOT NULL REFERENCES runs(run_id),\n    {columns}\n);"
    )


_MIGRATIONS[4] = [_record_table("scaling"), _record_table("cold_starts")]  # the autoscaler's tables
_MIGRATIONS[5] = ["ALTER TABLE decisions ADD COLUMN predicted_ttft REAL"]  # a predicting policy's TTFT
_MIGRATIONS[5] += [  # what a prefix-aware router believed cached, what the replica found (index staleness)
    "ALTER TABLE decisions ADD COLUMN believed_cached INTEGER",
    "ALTER TABLE requests ADD COLUMN cached_tokens INTEGER",
]
_MIGRATIONS[6] = [  # a prefill/decode hand-over's K/V moved with the request
    "ALTER TABLE migrations ADD COLUMN kv_bytes INTEGER",
    "ALTER TABLE migrations ADD COLUMN kv_seconds REAL",
]
_MIGRATIONS[7] = [  # a request's class for flow control (protocol.flow); older rows read as the defaults'
    "ALTER TABLE requests ADD COLUMN priority INTEGER",
    "ALTER TABLE requests ADD COLUMN tenant TEXT",
]


SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY,
    name TEXT,
    started REAL NOT NULL,
    ended REAL,                      -- NULL until end_run
    status TEXT NOT NULL,            -- 'running' until end_run: 'complete' | 'failed' | 'aborted'
    config TEXT,                     -- JSON object
    batching_policy TEXT,
    routing_policy TEXT,
    seed INTEGER,
    git_commit TEXT,                 -- HEAD, '-dirty' if the tree had changes; 'unknown' outside git
    machine TEXT,                    -- JSON object: hostname, platform, CPU model and flags, cpus, memory, GPUs
    simulated INTEGER NOT NULL DEFAULT 0,
    slo TEXT                         -- JSON object or NULL
);
CREATE TABLE IF NOT EXISTS requests (
    run_id INTEGER NOT NULL REFERENCES runs(run_id),
    request_id TEXT NOT NULL,
    replica_id TEXT,                 -- NULL if rejected before reaching a replica
    session_id TEXT,
    planned_arrival REAL,
    arrival REAL NOT NULL,
    submit_lateness REAL,
    first_token REAL,
    completion REAL NOT NULL,
    prompt_len INTEGER,
    output_len INTEGER,
    max_tokens INTEGER,
    finish_reason TEXT NOT NULL,     -- eos | stop | length | abort | error | rejected
    error TEXT,
    num_preemptions INTEGER,
    cached_tokens INTEGER,           -- prompt tokens the replica's prefix cache held at admission
    priority INTEGER,                -- its flow-control band (lower is served first); NULL: the default
    tenant TEXT,                     -- its tenant; NULL: the default
    PRIMARY KEY (run_id, request_id)
);
CREATE TABLE IF NOT EXISTS tokens (
    run_id INTEGER NOT NULL REFERENCES runs(run_id),
    request_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (run_id, request_id, idx)
);
"""
SCHEMA += "\n".join(
    [
        _record_table("steps"),
        "CREATE INDEX IF NOT EXISTS steps_by_run ON steps (run_id, replica_id, step);",
        _record_table("decisions"),
        "CREATE INDEX IF NOT EXISTS decisions_by_run ON decisions (run_id, time);",
        _MIGRATIONS_TABLE,
        _record_table("scaling"),
        _record_table("cold_starts"),
    ]
)

# Columns a batch row may carry (run_id comes from the call), the ones it must carry, and
# the ones stored as JSON text.
_COLUMNS = {
    "requests": (
        "request_id",
        "replica_id",
        "session_id",
        "planned_arrival",
        "arrival",
        "submit_lateness",
        "first_token",
        "completion",
        "prompt_len",
        "output_len",
        "max_tokens",
        "finish_reason",
        "error",
        "num_preemptions",
        "cached_tokens",
        "priority",
        "tenant",
    ),
    **{table: tuple(c.name for c in columns) for table, columns in _RECORD_TABLES.items()},
    "migrations": (
        "request_id",
        "time",
        "from_replica",
        "to_replica",
        "tokens_carried",
        "reason",
        "kv_bytes",
        "kv_seconds",
    ),
}
_REQUIRED = {
    "requests": ("request_id", "arrival", "completion", "finish_reason"),
    **{table: tuple(c.name for c in columns if c.required) for table, columns in _RECORD_TABLES.items()},
    "migrations": ("request_id", "from_replica"),
}
_JSON = {"config", "machine", "slo", *(c.name for columns in _RECORD_TABLES.values() for c in columns if c.json)}


class StoreError(SlotServeError):
    """The metrics store is missing, not a slotserve store, or was given a bad batch."""


class UnknownRunError(StoreError, KeyError):
    """No run has this id; the message lists the ids the store holds."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class MetricsStore:
    """One SQLite file of runs. Use from one process at a time for writes (the StoreActor);
    any number of readers may open the same file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            # check_same_thread=False: a Ray actor may call from a thread other than the one
            # that built it; its calls never overlap, so one connection is safe.
            self.conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:  # a new file; an existing store of this version is only read here, never locked
                self.conn.executescript(f"BEGIN;\n{SCHEMA}\nPRAGMA user_version={SCHEMA_VERSION};\nCOMMIT;")
            elif version in _MIGRATIONS:
                self._migrate(version)
            elif version != SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has store schema version {version}; this slotserve reads version {SCHEMA_VERSION}"
                )
        except sqlite3.DatabaseError as err:
            raise StoreError(f"cannot open {self.path} as a slotserve metrics store: {err}") from err

    def _migrate(self, version: int) -> None:
        """Bring an older store up to SCHEMA_VERSION: old rows keep NULL in the new columns."""
        self.conn.execute("BEGIN IMMEDIATE")  # one migrating writer; a second opener waits, then sees it done
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        while version < SCHEMA_VERSION:
            for statement in _MIGRATIONS[version]:
                self.conn.execute(statement)
            version += 1
            self.conn.execute(f"PRAGMA user_version={version}")
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    # --- writes -------------------------------------------------------------------------

    def begin_run(
        self,
        name: str,
        config: dict,
        batching_policy: str,
        routing_policy: str,
        seed: int,
        slo: dict | None = None,
        simulated: bool = False,
    ) -> int:
        """Record a new run as 'running' with the code version and machine; returns its id."""
        row = {
            "name": name,
            "started": time.time(),
            "status": "running",
            "config": config,
            "batching_policy": batching_policy,
            "routing_policy": routing_policy,
            "seed": seed,
            "git_commit": _git_commit(),
            "machine": _machine(),
            "simulated": int(simulated),
            "slo": slo,
        }
        with self.conn:
            cur = self.conn.execute(
                f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                [_encode(k, v) for k, v in row.items()],
            )
        return cur.lastrowid

    def end_run(self, run_id: int, status: str = "complete") -> None:
        """Stamp the run's end time and final status (one of END_STATUSES)."""
        if status not in END_STATUSES:
            raise StoreError(f"end_run status must be one of {', '.join(END_STATUSES)}; got {status!r}")
        with self.conn:
            cur = self.conn.execute(
                "UPDATE runs SET ended = ?, status = ? WHERE run_id = ?", (time.time(), status, run_id)
            )
        if cur.rowcount == 0:
            raise self._unknown_run(run_id)

    def add_requests(self, run_id: int, rows: list[dict]) -> None:
        """Write final request records; a row's optional `token_times` list goes to the tokens
        table (and fills `first_token` and `output_len` when the row leaves them out)."""
        requests, tokens = [], []
        for row in rows:
            row = dict(row)
            token_times = row.pop("token_times", None)
            if token_times is not None:
                if token_times:
                    row.setdefault("first_token", token_times[0])
                row.setdefault("output_len", len(token_times))
                tokens += [(run_id, row.get("request_id"), i, t) for i, t in enumerate(token_times)]
            requests.append(row)
        self._write(run_id, [_batch("requests", run_id, requests), ("INSERT INTO tokens VALUES (?, ?, ?, ?)", tokens)])

    def add_steps(self, run_id: int, rows: list[dict]) -> None:
        self._write(run_id, [_batch("steps", run_id, rows)])

    def add_decisions(self, run_id: int, rows: list[dict]) -> None:
        self._write(run_id, [_batch("decisions", run_id, rows)])

    def add_scaling(self, run_id: int, rows: list[dict]) -> None:
        """Autoscaling decisions: rows of `ScalingDecision`'s fields."""
        self._write(run_id, [_batch("scaling", run_id, rows)])

    def add_cold_starts(self, run_id: int, rows: list[dict]) -> None:
        """Replicas the autoscaler started: rows of `ColdStart`'s fields."""
        self._write(run_id, [_batch("cold_starts", run_id, rows)])

    def add_migrations(self, run_id: int, rows: list[dict]) -> None:
        """Requests moved to another replica (a lost or draining one): one row per move."""
        self._write(run_id, [_batch("migrations", run_id, rows)])

    def _write(self, run_id: int, batches: list[tuple[str, list]]) -> None:
        """Run every (sql, rows) batch in one transaction: all of it lands or none of it."""
        self.run(run_id)  # an unknown run id is named before anything is written
        try:
            with self.conn:
                for sql, params in batches:
                    self.conn.executemany(sql, params)
        except sqlite3.IntegrityError as err:
            raise StoreError(f"batch for run {run_id} not written (a row is already stored?): {err}") from err

    # --- reads --------------------------------------------------------------------------

    def runs(self) -> list[dict]:
        return [_run_dict(r) for r in self.conn.execute("SELECT * FROM runs ORDER BY run_id")]

    def run(self, run_id: int) -> dict:
        row = self.conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise self._unknown_run(run_id)
        return _run_dict(row)

    def traces(self, run_id: int) -> list[RequestTrace]:
        """The run's requests as `RequestTrace`s (token times in idx order), by request id."""
        self.run(run_id)
        times: dict[str, list[float]] = {}
        for request_id, t in self.conn.execute(
            "SELECT request_id, time FROM tokens WHERE run_id = ? ORDER BY request_id, idx", (run_id,)
        ):
            times.setdefault(request_id, []).append(t)
        return [
            RequestTrace(
                r["request_id"],
                r["arrival"],
                times.get(r["request_id"], []),
                r["completion"],
                r["finish_reason"],
                r["prompt_len"] or 0,
                r["replica_id"],
                r["num_preemptions"] or 0,
                cached_tokens=r["cached_tokens"],
                priority=defaults.PRIORITY if r["priority"] is None else r["priority"],
                tenant=r["tenant"] or defaults.TENANT,
            )
            for r in self.conn.execute("SELECT * FROM requests WHERE run_id = ? ORDER BY request_id", (run_id,))
        ]

    def requests(self, run_id: int) -> list[dict]:
        """The run's request rows as stored (with planned arrival and submit lateness)."""
        self.run(run_id)
        return [
            dict(r) for r in self.conn.execute("SELECT * FROM requests WHERE run_id = ? ORDER BY request_id", (run_id,))
        ]

    def steps(self, run_id: int) -> list[dict]:
        self.run(run_id)
        return [
            dict(r)
            for r in self.conn.execute("SELECT * FROM steps WHERE run_id = ? ORDER BY replica_id, step", (run_id,))
        ]

    def decisions(self, run_id: int) -> list[dict]:
        self.run(run_id)
        return [
            {k: _decode(k, r[k]) for k in r.keys()}
            for r in self.conn.execute("SELECT * FROM decisions WHERE run_id = ? ORDER BY time, rowid", (run_id,))
        ]

    def scaling(self, run_id: int) -> list[dict]:
        """The run's autoscaling decisions in time order (inputs decoded)."""
        return self._rows("scaling", run_id, "time, rowid")

    def cold_starts(self, run_id: int) -> list[dict]:
        return self._rows("cold_starts", run_id, "requested, rowid")

    def _rows(self, table: str, run_id: int, order: str) -> list[dict]:
        self.run(run_id)
        return [
            {k: _decode(k, r[k]) for k in r.keys()}
            for r in self.conn.execute(f"SELECT * FROM {table} WHERE run_id = ? ORDER BY {order}", (run_id,))
        ]

    def migrations(self, run_id: int) -> list[dict]:
        self.run(run_id)
        return [
            dict(r)
            for r in self.conn.execute("SELECT * FROM migrations WHERE run_id = ? ORDER BY time, rowid", (run_id,))
        ]

    def _unknown_run(self, run_id: int) -> UnknownRunError:
        known = [r[0] for r in self.conn.execute("SELECT run_id FROM runs ORDER BY run_id")]
        listed = ", ".join(map(str, known)) if known else "none"
        return UnknownRunError(f"no run {run_id} in {self.path}; runs stored: {listed}")


def open_store(path: str | Path = DEFAULT_STORE) -> MetricsStore:
    """Open (creating the file and its parent folders if needed) the store at `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return MetricsStore(path)


def _batch(table: str, run_id: int, rows: list[dict]) -> tuple[str, list]:
    """The INSERT statement and parameter rows for a batch, after checking every row's keys."""
    columns, required = _COLUMNS[table], _REQUIRED[table]
    for n, row in enumerate(rows):
        unknown = [k for k in row if k not in columns]
        if unknown:
            raise StoreError(f"{table} row {n}: unknown column {unknown[0]!r}; known: {', '.join(columns)}")
        missing = [k for k in required if row.get(k) is None]
        if missing:
            raise StoreError(f"{table} row {n}: missing required column {missing[0]!r}")
    sql = f"INSERT INTO {table} (run_id, {', '.join(columns)}) VALUES (?{', ?' * len(columns)})"
    return sql, [[run_id] + [_encode(c, row.get(c)) for c in columns] for row in rows]


def _encode(column: str, value):
    """JSON columns take a dict, or its JSON text as is (never encoded twice)."""
    if column not in _JSON or value is None:
        return value
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            raise StoreError(f"column {column!r} takes a dict or a JSON object's text; got {value[:80]!r}")
        return value
    return json.dumps(value)


def _decode(column: str, value):
    return json.loads(value) if column in _JSON and value is not None else value


def _run_dict(row: sqlite3.Row) -> dict:
    run = {k: _decode(k, row[k]) for k in row.keys()}
    run["simulated"] = bool(run["simulated"])
    run["complete"] = run["status"] == "complete"
    return run


def _git_commit() -> str:
    """HEAD of the checkout this code runs from, with '-dirty' if it has uncommitted changes,
    so a run is never credited to a commit that lacks the code it ran."""
    cwd = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=cwd, capture_output=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.returncode == 1 else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _machine() -> dict:
    """What results depend on: host, OS, Python, the CPU (its model and the flags that change a
    matrix product: machines of one kind differ), CPUs this process may use, memory, GPUs."""
    cpu = cpu_info()
    machine = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu.model,
        "cpu_flags": cpu.shown_flags,
    }
    if hasattr(os, "sched_getaffinity"):
        machine["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        machine["memory_gib"] = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            machine["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return machine
