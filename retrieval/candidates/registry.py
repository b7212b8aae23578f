"""Every candidate structure kind, by name: one line each. retrieval.index_format (the manifest's `kind`),
structures, `ann`'s flags and help, and the docs read this, so a new kind is its module and its line here."""

from __future__ import annotations

from retrieval.candidates.binary import Binary
from retrieval.candidates.hnsw import Hnsw
from retrieval.candidates.int8 import Int8
from retrieval.candidates.ivf import Ivf
from retrieval.candidates.kind import Kind, Param
from retrieval.candidates.pq import Pq

KINDS: dict[str, Kind] = {kind.name: kind for kind in (Hnsw(), Ivf(), Binary(), Int8(), Pq())}


def kind(name: str) -> Kind:
    """The kind called `name`; ValueError naming the known ones for any other."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {name!r}") from None


def params_by_name() -> dict[str, tuple[Param, list[str]]]:
    """Every parameter of every kind, once by its name (kinds that share one, as ivf and pq share nlist and
    nprobe, share its flag), with the kinds that have it."""
    found: dict[str, tuple[Param, list[str]]] = {}
    for each in KINDS.values():
        for name, param in each.params.items():
            found.setdefault(name, (param, []))[1].append(each.name)
    return found


def owners(name: str) -> list[str]:
    """The kinds that have a parameter called `name`."""
    return params_by_name().get(name, (None, []))[1]
