"""Row -> (id, text, metadata fields) on disk in SQLite, so the passage text never has to fit in RAM."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Mapping, Sequence

from retrieval.fields import FieldColumns, has_fields_column

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
    """Read-only access; one SQLite connection per thread (connections are not thread-safe)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: passage store missing")
        self._local = threading.local()

    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
            self._local.connection = connection
        return connection

    def row_range(self) -> tuple[int, int, int]:
        """(rows stored, smallest row, largest row); an index's rows are 0 .. count - 1."""
        count, low, high = self._connection().execute("SELECT COUNT(*), MIN(row), MAX(row) FROM passages").fetchone()
        return count, (low if low is not None else 0), (high if high is not None else -1)

    def get(self, rows: Sequence[int]) -> list[tuple[str, str]]:
        """(id, text) for each row, in the order asked."""
        return [(pid, text) for pid, text, _ in self.records(rows)]

    def records(self, rows: Sequence[int]) -> list[tuple[str, str, int]]:
        """(id, text, corpus line) for each row, in the order asked."""
        if not rows:
            return []
        wanted = sorted(set(int(r) for r in rows))
        found: dict[int, tuple[str, str, int]] = {}
        connection = self._connection()
        for start in range(0, len(wanted), 900):  # SQLite caps bound parameters
            part = wanted[start : start + 900]
            marks = ",".join("?" * len(part))
            for row, pid, text, line in connection.execute(
                f"SELECT row, id, text, line FROM passages WHERE row IN ({marks})", part
            ):
                found[row] = (pid, text, line)
        missing = [r for r in wanted if r not in found]
        if missing:
            raise KeyError(f"{self.path}: rows {missing[:5]} not in the passage store")
        return [found[int(r)] for r in rows]

    def fields(self, rows: Sequence[int]) -> list[dict]:
        """Each row's metadata fields (retrieval.fields), in the order asked; {} for none, and for every row
        of a store written before the `fields` column existed."""
        connection = self._connection()
        if not rows or not has_fields_column(connection):
            return [{} for _ in rows]
        wanted = sorted(set(int(r) for r in rows))
        found: dict[int, dict] = {}
        for start in range(0, len(wanted), 900):
            part = wanted[start : start + 900]
            marks = ",".join("?" * len(part))
            query = f"SELECT row, fields FROM passages WHERE row IN ({marks}) AND fields IS NOT NULL"
            found.update((row, json.loads(stored)) for row, stored in connection.execute(query, part))
        return [found.get(int(r), {}) for r in rows]

    def field_columns(self, types: Mapping[str, str], count: int) -> FieldColumns:
        """The columns of the fields `types` names (the manifest's), read once (retrieval.fields.FieldColumns)."""
        return FieldColumns.load(self._connection(), types, count)
