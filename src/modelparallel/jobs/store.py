"""The job store: one SQLite database recording every job, its status transitions and
its metrics.

Several processes write at once (a runner per job, the CLI stopping one), so the
database is in WAL mode, every write is one ``BEGIN IMMEDIATE`` transaction, and a
writer waits (``busy_timeout``) instead of failing while another holds the lock.
"""

from __future__ import annotations

import builtins
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

TERMINAL = ("Completed", "Failed", "Stopped")
# secondary status (what the job is doing) -> primary status (SageMaker's names)
PRIMARY = {"Pending": "InProgress", "Starting": "InProgress", "Training": "InProgress",
           "Stopping": "Stopping",
           "Completed": "Completed", "Failed": "Failed", "Stopped": "Stopped",
           "MaxRuntimeExceeded": "Stopped"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    secondary_status TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    backend TEXT NOT NULL,
    job_dir TEXT NOT NULL,
    spec TEXT NOT NULL,
    hyperparameters TEXT NOT NULL,
    instance_count INTEGER NOT NULL,
    processes_per_host INTEGER NOT NULL,
    layout TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    runner_pid INTEGER,
    runner_host TEXT,
    backend_info TEXT,
    exit_codes TEXT,
    failure_reason TEXT,
    model_uri TEXT,
    output_uri TEXT,
    checkpoint_uri TEXT
);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL REFERENCES jobs(name),
    attempt INTEGER NOT NULL,
    status TEXT NOT NULL,
    at REAL NOT NULL,
    message TEXT
);
CREATE TABLE IF NOT EXISTS metrics (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL REFERENCES jobs(name),
    attempt INTEGER NOT NULL,
    metric TEXT NOT NULL,
    value REAL NOT NULL,
    step INTEGER,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_by_job ON transitions(name, id);
CREATE INDEX IF NOT EXISTS metrics_by_job ON metrics(name, metric, id);
"""

_JSON_COLUMNS = ("hyperparameters", "backend_info", "exit_codes", "spec")
UPDATABLE = ("layout", "runner_pid", "runner_host", "backend_info", "exit_codes",
             "failure_reason", "model_uri", "output_uri")


def default_jobs_dir() -> Path:
    """``$MODELPARALLEL_JOBS_DIR``, else the user's data directory
    (``$XDG_DATA_HOME/modelparallel/jobs``, ``~/.local/share/modelparallel/jobs``)."""
    if os.environ.get("MODELPARALLEL_JOBS_DIR"):
        return Path(os.environ["MODELPARALLEL_JOBS_DIR"]).expanduser().resolve()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "modelparallel" / "jobs"


class JobExists(RuntimeError):
    """A job of that name is still running."""


PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700  # a job store is its user's alone


class JobStore:
    """The SQLite database at ``path`` (created on first use), readable and writable by
    its user only (0600; SQLite gives its -wal and -shm files the same mode). A new
    jobs directory is made 0700; an existing one is left as it is."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.parent.is_dir():
            self.path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            os.chmod(self.path.parent, PRIVATE_DIR)  # mkdir's mode is masked by the umask
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, PRIVATE_FILE))
        os.chmod(self.path, PRIVATE_FILE)  # a store made before this was 0644
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA busy_timeout=60000")
        try:
            yield db
        finally:
            db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; waits for other writers instead of failing."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # -- writes -------------------------------------------------------------------------
    def begin(self, name: str, *, spec: dict[str, Any], job_dir: str, backend: str,
              checkpoint_uri: str | None) -> int:
        """Record a new job, or a new attempt of an ended one (a resume); its attempt."""
        now = time.time()
        with self._write() as db:
            row = db.execute("SELECT status, attempt FROM jobs WHERE name=?",
                             (name,)).fetchone()
            if row is not None and row["status"] not in TERMINAL:
                raise JobExists(f"job {name!r} is {row['status']}; stop it first "
                                f"(`modelparallel jobs stop {name}`) or choose another name")
            attempt = 1 if row is None else row["attempt"] + 1
            values = dict(name=name, status="InProgress", secondary_status="Pending",
                          attempt=attempt, backend=backend, job_dir=job_dir,
                          spec=json.dumps(spec), hyperparameters=json.dumps(
                              spec.get("hyperparameters", {})),
                          instance_count=spec["instance_count"],
                          processes_per_host=spec["processes_per_host"], created_at=now,
                          started_at=None, ended_at=None, runner_pid=None, runner_host=None,
                          backend_info=None, exit_codes=None, failure_reason=None,
                          model_uri=None, output_uri=None, checkpoint_uri=checkpoint_uri,
                          layout=None)
            cols = ", ".join(values)
            db.execute(f"INSERT OR REPLACE INTO jobs ({cols}) VALUES "
                       f"({', '.join('?' * len(values))})", tuple(values.values()))
            db.execute("INSERT INTO transitions (name, attempt, status, at, message) "
                       "VALUES (?, ?, ?, ?, ?)",
                       (name, attempt, "Pending", now,
                        "resumed" if attempt > 1 else "submitted"))
        return attempt

    def transition(self, name: str, secondary: str, message: str | None = None) -> bool:
        """Move the job to ``secondary`` status; False if it had already ended (a job
        that ended stays as it ended)."""
        now = time.time()
        with self._write() as db:
            row = db.execute("SELECT status, attempt FROM jobs WHERE name=?",
                             (name,)).fetchone()
            if row is None or row["status"] in TERMINAL:
                return False
            primary = PRIMARY[secondary]
            if row["status"] == "Stopping" and primary == "InProgress":
                return False  # a stop was asked for; only an end may follow
            db.execute("UPDATE jobs SET status=?, secondary_status=? WHERE name=?",
                       (primary, secondary, name))
            if secondary == "Training":
                db.execute("UPDATE jobs SET started_at=COALESCE(started_at, ?) WHERE name=?",
                           (now, name))
            if primary in TERMINAL:
                db.execute("UPDATE jobs SET ended_at=? WHERE name=?", (now, name))
            db.execute("INSERT INTO transitions (name, attempt, status, at, message) "
                       "VALUES (?, ?, ?, ?, ?)", (name, row["attempt"], secondary, now,
                                                  message))
        return True

    def update(self, name: str, **fields: Any) -> None:
        bad = set(fields) - set(UPDATABLE)
        if bad:
            raise ValueError(f"cannot update {sorted(bad)}")
        values = {k: json.dumps(v) if k in _JSON_COLUMNS else v for k, v in fields.items()}
        with self._write() as db:
            db.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in values)} WHERE name=?",
                       (*values.values(), name))

    def add_metrics(self, name: str, attempt: int,
                    values: list[tuple[str, float, int | None, float]]) -> None:
        """Append ``(metric, value, step, timestamp)`` rows."""
        if not values:
            return
        with self._write() as db:
            db.executemany("INSERT INTO metrics (name, attempt, metric, value, step, at) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                           [(name, attempt, *v) for v in values])

    # -- reads --------------------------------------------------------------------------
    def get(self, name: str) -> dict[str, Any] | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE name=?", (name,)).fetchone()
        return _decode(row) if row is not None else None

    def require(self, name: str) -> dict[str, Any]:
        """The record of job ``name``; a LookupError if there is none."""
        record = self.get(name)
        if record is None:
            raise LookupError(f"no training job named {name!r}")
        return record

    def list(self, status: str | None = None) -> list[dict[str, Any]]:
        query, args = "SELECT * FROM jobs", cast(tuple[Any, ...], ())
        if status:
            query, args = query + " WHERE status=? OR secondary_status=?", (status, status)
        with self._connect() as db:
            rows = db.execute(query + " ORDER BY created_at DESC", args).fetchall()
        return [_decode(r) for r in rows]

    def transitions(self, name: str) -> builtins.list[dict[str, Any]]:
        with self._connect() as db:
            rows = db.execute("SELECT attempt, status, at, message FROM transitions "
                              "WHERE name=? ORDER BY id", (name,)).fetchall()
        return [dict(r) for r in rows]

    def metrics(self, name: str, attempt: int | None = None) -> builtins.list[dict[str, Any]]:
        query = "SELECT attempt, metric, value, step, at FROM metrics WHERE name=?"
        args: tuple[Any, ...] = (name,)
        if attempt is not None:
            query, args = query + " AND attempt=?", (name, attempt)
        with self._connect() as db:
            rows = db.execute(query + " ORDER BY id", args).fetchall()
        return [dict(r) for r in rows]


def _decode(row: sqlite3.Row) -> dict[str, Any]:
    data = dict(row)
    for key in _JSON_COLUMNS:
        if data.get(key) is not None:
            data[key] = json.loads(data[key])
    return data
