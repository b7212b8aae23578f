"""Format 1 read as format 2: the one step through which this code reads an index folder an older version wrote.

Format 2 (retrieval.index_format) states in every manifest what format 1 left to defaults: the encoder's backend,
export and prefixes, the candidate structures and metadata fields (empty where none), and the manifest's own
digest; it always writes `text-sha256.npy` and the passage store's `fields` column. A format-1 folder is not
rewritten (a replica may read it from a read-only volume): its manifest is upgraded as it is read (`manifest`),
its passage store is read through a view that gives it the `fields` column (`passages`), and the content hashes
an update matches passages by are computed from its stored texts where it has no file of them
(retrieval.text_hashes.index_text_hashes).
A new generation written from it (an update, a merge) is format 2; `ann` keeps the folder's own format."""

from __future__ import annotations

import sqlite3

OLDEST = 1
DEFAULTS = {"candidates": [], "fields": {}}  # none of either in format 1 unless listed
ENCODER_DEFAULTS = {"backend": "torch", "export_sha256": None, "query_prefix": "", "passage_prefix": ""}
DROPPED = ("dimension", "similarity", "manifest_sha256")  # format 1's top-level copies of the encoder's; its digest


def manifest(raw: dict) -> dict:
    """A format-1 manifest's fields as format 2 states them (its digest, checked by the caller, left out: the caller
    seals the result); `format_version` stays 1, so that a writer that reseals the folder in place keeps its format."""
    upgraded = {name: value for name, value in raw.items() if name not in DROPPED}
    upgraded["encoder"] = {**ENCODER_DEFAULTS, **raw["encoder"]} if isinstance(raw.get("encoder"), dict) else raw.get("encoder")
    if isinstance(raw.get("corpus"), dict):
        upgraded["corpus"] = {"sha256": None, **raw["corpus"]}
    return {**DEFAULTS, **upgraded}


def passages(connection: sqlite3.Connection, format_version: int) -> None:
    """Makes `connection`'s `passages`, of an index of `format_version`, read as format 2's: a format-1 store may
    lack the `fields` column, and a temporary view with it (NULL: no fields) then shadows the table for this
    connection only."""
    if format_version != OLDEST:
        return
    columns = [column[1] for column in connection.execute("PRAGMA main.table_info(passages)")]
    if "fields" not in columns:
        connection.execute("CREATE TEMP VIEW passages AS SELECT row, id, text, line, NULL AS fields FROM main.passages")

