"""Row -> (id, text, metadata fields) on disk in SQLite, so the passage text never has to fit in RAM."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Mapping, Sequence

from retrieval import format_upgrade
from retrieval.fields import FieldColumns
from retrieval.index_format import FORMAT_VERSION
from retrieval.pinned import sqlite_uri

SCHEMA = """
CREATE TABLE IF NOT EXISTS passages (
    row  INTEGER PRIMARY KEY,   -- the FAISS row
    id   TEXT NOT NULL UNIQUE,  -- the collection's own passage id
    text TEXT NOT NULL,
    line INTEGER NOT NULL,      -- line of the corpus file it came from
    fields TEXT                 -- its metadata fields as a JSON object (retrieval.fields), NULL for none
);
"""


class PassageStore:
    """Read-only access through one SQLite connection, opened here (so the store read is the file at `path`
    now, whatever is renamed over it later: retrieval.pinned) and shared by every thread, one query at a time.
    `format_version`: the index's (a format-1 store is read through retrieval.format_upgrade)."""

    def __init__(self, path: str | Path, format_version: int = FORMAT_VERSION) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: passage store missing")
        self._lock = threading.Lock()
        self._connection = sqlite3.connect(sqlite_uri(self.path), uri=True, check_same_thread=False)
        with self._lock:  # the file is opened by the first statement, so here and now
            self._connection.execute("PRAGMA main.schema_version").fetchone()
            format_upgrade.passages(self._connection, format_version)

    def _query(self, sql: str, parameters: Sequence = ()) -> list[tuple]:
        with self._lock:
            return self._connection.execute(sql, parameters).fetchall()

    def row_range(self) -> tuple[int, int, int]:
        """(rows stored, smallest row, largest row); an index's rows are 0 .. count - 1."""
        (count, low, high), = self._query("SELECT COUNT(*), MIN(row), MAX(row) FROM passages")
        return count, (low if low is not None else 0), (high if high is not None else -1)

    def get(self, rows: Sequence[int]) -> list[tuple[str, str]]:
        """(id, text) for each row, in the order asked."""
        return [(pid, text) for pid, text, _ in self.records(rows)]

    def records(self, rows: Sequence[int]) -> list[tuple[str, str, int]]:
        """(id, text, corpus line) for each row, in the order asked."""
        found = {row: (pid, text, line) for row, pid, text, line in self._rows("row, id, text, line", rows)}
        missing = sorted(set(int(r) for r in rows) - found.keys())
        if missing:
            raise KeyError(f"{self.path}: rows {missing[:5]} not in the passage store")
        return [found[int(r)] for r in rows]

    def ids(self, rows: Sequence[int]) -> list[str]:
        """The id of each row, in the order asked."""
        found = dict(self._rows("row, id", rows))
        return [found[int(r)] for r in rows]

    def rows_of(self, ids: Sequence[str]) -> dict[str, int]:
        """The row of each of `ids` the store holds."""
        found: dict[str, int] = {}
        for start in range(0, len(ids), 900):  # SQLite caps bound parameters
            part = list(ids[start : start + 900])
            found.update(self._query(f"SELECT id, row FROM passages WHERE id IN ({','.join('?' * len(part))})", part))
        return found

    def texts(self) -> list[str]:
        """Every row's text, in row order."""
        return [text for (text,) in self._query("SELECT text FROM passages ORDER BY row")]

    def fields(self, rows: Sequence[int]) -> list[dict]:
        """Each row's metadata fields (retrieval.fields), in the order asked; {} for none."""
        if not rows:
            return []
        found = {row: json.loads(stored) for row, stored in self._rows("row, fields", rows, "AND fields IS NOT NULL")}
        return [found.get(int(r), {}) for r in rows]

    def _rows(self, columns: str, rows: Sequence[int], condition: str = "") -> list[tuple]:
        wanted = sorted(set(int(r) for r in rows))
        found = []
        for start in range(0, len(wanted), 900):  # SQLite caps bound parameters
            part = wanted[start : start + 900]
            marks = ",".join("?" * len(part))
            found += self._query(f"SELECT {columns} FROM passages WHERE row IN ({marks}) {condition}", part)
        return found

    def field_columns(self, types: Mapping[str, str], count: int) -> FieldColumns:
        """The columns of the fields `types` names (the manifest's), read once (retrieval.fields.FieldColumns)."""
        with self._lock:
            return FieldColumns.load(self._connection, types, count)
