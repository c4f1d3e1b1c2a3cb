"""The lm-eval model's persistent answer cache: one SQLite file, one row per answered request.

A key covers everything that decides an answer: the request type and its arguments, the response schema's
hash, the model's identity (path and a fingerprint of its files) and the engine settings that change outputs
(backend, dtype, generation and guard settings, ``constrained``, ``on_invalid``...). So a schema change or a
settings change never reuses an answer. Each batch is written in one transaction (SQLite's journal makes a
killed writer lose at most the batch in flight, never corrupt what was committed). A file that is not a
readable SQLite database is moved aside and rebuilt, with a warning; a file another process keeps locked past
``timeout_s`` is an error that says so.

lm-eval's own ``--use_cache`` (``CachingLM``) wraps any model from the outside and keys by request arguments
only: it would return a cached answer after a schema or settings change. Use this cache (``cache=PATH`` in
``--model_args``) instead; if both are on, lm-eval's answers first, from its own file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from engine.errors import EngineError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class CacheError(EngineError):
    """The cache file cannot be used (locked by another process, unwritable); the message says what to do."""


def cache_key(kind: str, args: Any, context: Mapping[str, Any]) -> str:
    """The key of one request: sha256 over its type, its arguments and the answer-deciding ``context``.

    >>> a = cache_key("generate_until", ["Q", {"until": ["\\n"]}], {"schema": "s1"})
    >>> a == cache_key("generate_until", ["Q", {"until": ["\\n"]}], {"schema": "s2"})
    False
    """
    blob = json.dumps([kind, args, context], sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class AnswerCache:
    """A persistent map from request keys to JSON answers.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "answers.sqlite")
    >>> with AnswerCache(path) as cache:
    ...     cache.put_many({"k1": [-1.5, True]})
    ...     cache.get_many(["k1", "k2"])
    {'k1': [-1.5, True]}
    """

    def __init__(self, path: str | Path, *, timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = self._open()
        except sqlite3.OperationalError as err:
            if "locked" in str(err) or "busy" in str(err):
                raise self._locked(err) from err
            raise CacheError(f"cache {self.path} cannot be opened ({err}). Fix: check the folder's permissions, "
                             "or give another cache path") from err
        except sqlite3.DatabaseError as err:  # not a database, or damaged: set it aside and start over
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            log.warning("cache %s is not a usable SQLite database (%s): moved to %s, starting an empty cache",
                        self.path, err, aside)
            self.path.rename(aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, kind TEXT NOT NULL, "
                       "value TEXT NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        except sqlite3.Error:
            db.close()
            raise
        return db

    def _locked(self, err: Exception) -> CacheError:
        return CacheError(f"cache {self.path} is locked by another process (waited {self.timeout_s:g} s: {err}). "
                          "Fix: wait for the other run to finish, or give this run its own cache path")

    def get_many(self, keys: Iterable[str]) -> dict[str, Any]:
        """The cached answers among ``keys`` (missing keys are absent)."""
        wanted = list(dict.fromkeys(keys))
        found: dict[str, Any] = {}
        for first in range(0, len(wanted), 500):
            chunk = wanted[first : first + 500]
            marks = ",".join("?" * len(chunk))
            try:
                rows = self._db.execute(f"SELECT key, value FROM answers WHERE key IN ({marks})", chunk).fetchall()
            except sqlite3.OperationalError as err:
                raise self._locked(err) from err
            found.update((k, json.loads(v)) for k, v in rows)
        return found

    def put_many(self, answers: Mapping[str, Any], kind: str = "") -> None:
        """Store ``answers`` (key -> JSON value) in one transaction."""
        rows = [(k, kind, json.dumps(v, ensure_ascii=False)) for k, v in answers.items()]
        try:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("INSERT OR REPLACE INTO answers VALUES (?, ?, ?)", rows)
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as err:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise self._locked(err) from err

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> AnswerCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
