"""A SearchEngine over an index split into `build --shard i/N` shards, each searched by a client
(in this process, or a Ray Serve deployment: service/sharded/deployments.py): the queries are encoded here, their
vectors scattered to every shard, and the shards' own top-k lists merged exactly
(retrieval.sharding.merge_top_k), so the answers equal one flat index over the same passages. Where every
shard carries a candidate structure of one kind, each answers through its own (its candidates scored
exactly), unless a search asks the exact scan: the scores stay exact, so the merge is unchanged.
Nothing here imports Ray."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from models.backends import Backend
from models.encoder import Tokens
from retrieval.dense import check_candidates
from retrieval.fields import chosen_fields, merged_types
from retrieval.filters import Filter, parse_filter
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, Manifest, generation_id
from retrieval.request import MAX_K, Defaults, Fusion, Lead, Mode, Retrieval
from retrieval.searcher import (Hit, HitWithFields, check_encoder, dense_score_kind, encoder_for, reranker_backend,
                                validate_k)
from retrieval.sharding import ShardHit, ShardIndex, build_identity, check_shard_set, merge_top_k
from service.engine.search_engine import Fetch, ReloadError, SearchEngine, SearchPlan, load_rerankers
from service.errors import ShardsUnavailable

# Past the deadline, an answer that came while an earlier shard was awaited is still taken: over gRPC
# (service/sharded/placement.py's SERVE_ENV) Serve fetches it through its router's loop, which a zero timeout never
# gives time to. At worst a search waits timeout_s plus this for each shard behind a silent one.
FETCH_GRACE_S = 0.25
log = logging.getLogger("service")


class Pending(Protocol):
    def result(self, timeout_s: float | None = None) -> list[list[ShardHit]]: ...


class ShardClient(Protocol):
    """One shard as the engine reaches it: `name` for messages, `describe()` its index directory, manifest
    and loaded structures (describe_shard), `search(vectors, k, build, **options)` its top k per vector
    (ShardIndex.search; `options`, structure and candidates, only where it answers through a structure),
    answered through `result(timeout_s)` (a failure where the replica's `build_identity` is not `build`)."""

    name: str

    def describe(self) -> dict: ...

    def search(self, vectors: np.ndarray, k: int, build: str | None = None, **options) -> Pending: ...


class _Done:
    def __init__(self, value: list[list[ShardHit]]) -> None:
        self.value = value

    def result(self, timeout_s: float | None = None) -> list[list[ShardHit]]:
        return self.value


class LocalShard:
    """A shard searched in this process (tests, and a machine that holds every shard)."""

    def __init__(self, index: ShardIndex, name: str | None = None) -> None:
        self.index, self.name = index, name or str(index.index_dir)

    def describe(self) -> dict:
        return describe_shard(self.index)

    def search(self, vectors: np.ndarray, k: int, build: str | None = None, **options) -> Pending:
        return _Done(self.index.search(vectors, k, build, **options))


def describe_shard(index: ShardIndex) -> dict:
    """What the ingress needs of a shard it may not see the files of: its folder, manifest and the kinds of
    candidate structure it loaded (in the manifest's order; none on a GPU)."""
    return {"index_dir": str(index.index_dir), "manifest": index.manifest.model_dump(mode="json"),
            "structures": list(index.structures)}


def shared_structures(shards: Sequence[str], loaded: Sequence[Sequence[str]]) -> list[str]:
    """The kinds of candidate structure every shard loaded (`loaded`, each shard's), in the first's order:
    a sharded search answers through the first of them. Where there is none but some shard loaded one all
    the same (an `ann` over the shards stopped midway, shards built apart), every search scans (exact, and
    so always right; through some shards' structures only, a passage's chance to be found would depend on
    its shard), and a warning names what each shard holds."""
    common = [kind for kind in loaded[0] if all(kind in kinds for kinds in loaded)]
    if not common and any(loaded):
        held = "; ".join(f"{shard}: {', '.join(kinds) or 'none'}" for shard, kinds in zip(shards, loaded))
        log.warning("the shards carry no candidate structure of one kind (%s): every search scans every vector; "
                    "build one in each shard (python -m index_builder ann --index SHARDS_FOLDER --kind KIND)", held)
    return common


class ShardedSearcher:
    """What SearchEngine needs of a Searcher (encoder, manifest, check, score_kind, encode), over shards:
    dense retrieval only, since BM25's statistics (document frequencies, average length) are corpus-wide
    and a shard's own would score differently from the whole index's."""

    def __init__(self, clients: Sequence[ShardClient], encoder, timeout_s: float,
                 defaults: Defaults = Defaults()) -> None:
        self.encoder, self.timeout_s, self.defaults = encoder, timeout_s, defaults
        described = [client.describe() for client in clients]
        manifests = [Manifest.model_validate(d["manifest"]) for d in described]
        found = check_shard_set(
            [(f"{client.name} ({d['index_dir']})", m) for client, d, m in zip(clients, described, manifests)])
        order = sorted(range(len(found)), key=lambda position: found[position].index)  # shard 0/N first
        self.clients = [clients[p] for p in order]
        self.shards = [str(found[p]) for p in order]
        self.index_dirs = [described[p]["index_dir"] for p in order]
        self.manifests = [manifests[p] for p in order]
        self.manifest = self.manifests[0]  # the encoder record every shard shares
        # Each search names the build checked here: a replica started later answers only if it holds the same.
        self.builds = [build_identity(m) for m in self.manifests]
        self.generation = hashlib.sha256(",".join(generation_id(m) for m in self.manifests).encode()).hexdigest()[:16]
        self.count = sum(m.count for m in manifests)
        check_encoder(self.manifest, encoder)
        # The fields of every shard together: a filter is checked against them once, here; a shard none of
        # whose passages has a field finds it absent from each.
        self.field_types = merged_types([(shard, m.fields) for shard, m in zip(self.shards, self.manifests)])
        self.index_dir = Path(self.index_dirs[0]).parent
        kinds = shared_structures(self.shards, [described[p].get("structures", []) for p in order])
        self.structure = kinds[0] if kinds else None  # None: every search scans
        # Each shard's recall card of each kind they all carry: measured on the shard's own passages.
        self.cards = [{"shard": shard, **record.model_dump()} for shard, manifest in zip(self.shards, self.manifests)
                      for record in manifest.candidates if record.kind in kinds]

    def request(self, k: int = 10, *, mode: Mode | None = None, fusion: Fusion | None = None, lead: Lead = "dense",
                exact: bool = False, candidates: int | None = None, structure: str | None = None, filter=None,
                fields=None, fusion_depth: int = MAX_K, dense_weight: float | None = None,
                feedback=None) -> Retrieval:
        """A search over the shards, checked as Searcher.request checks one (the fields of every shard together;
        `structure`: none, or the kind every shard carries). A search naming no mode is dense here: shards
        serve no BM25 (see `check`), unless `defaults` names another mode, which `check` refuses. `dense_weight`
        and `feedback` weigh a hybrid z-score search only, so a dense one ignores them, as Searcher's does."""
        validate_k(k)
        check_candidates(candidates)
        retrieval = Retrieval(k, *self.defaults.resolve(mode, fusion, False), lead, bool(exact), candidates,
                              structure, self.parse_filter(filter), chosen_fields(fields, self.field_types),
                              fusion_depth)
        self.check(retrieval)
        return retrieval

    def rebased(self, retrieval: Retrieval) -> Retrieval:
        """Searcher.rebased over the shards: `retrieval` checked, its mode unchanged (shards serve no BM25 in any
        generation, so a default resolves alike in every one)."""
        self.check(retrieval)
        return retrieval

    def check(self, retrieval: Retrieval) -> None:
        if retrieval.mode != "dense":
            raise ValueError(
                f"{retrieval.mode!r} is not served over shards: BM25's statistics (document frequencies, average "
                "passage length) are corpus-wide, so a shard's BM25 scores differ from the whole index's; use dense, "
                "or serve the merged index (index_builder merge) with python -m service")
        if retrieval.structure is not None and retrieval.structure != self.structure:
            raise ValueError(f"structure {retrieval.structure!r} is not one every shard carries "
                             f"(they share: {self.structure or 'none'})")
        if retrieval.filter is not None:
            retrieval.filter.check(self.field_types)

    def parse_filter(self, filter) -> Filter | None:
        """`filter` checked against the fields of every shard together (retrieval.filters.FilterError)."""
        return None if filter is None else parse_filter(filter, self.field_types)

    def score_kind(self, retrieval: Retrieval) -> str:
        return dense_score_kind(self.manifest)

    def answered_by(self, retrieval: Retrieval) -> str:
        """"exact" (every shard scans its vectors; with a filter, each scans the rows it matches) or
        "approximate:KIND" (each answers through its own KIND structure, candidates scored exactly)."""
        if retrieval.exact or retrieval.filter is not None or self.structure is None:
            return "exact"
        return f"approximate:{self.structure}"

    def encode(self, queries: Sequence[str], tokens: Sequence[Tokens] | None = None) -> np.ndarray:
        return self.encoder.encode_texts(queries, tokens)

    def scatter(self, vectors: np.ndarray,
                retrieval: Retrieval) -> Callable[[bool], tuple[list[list[Hit]], dict]]:
        """The vectors sent to every shard now, and the call that waits for their answers (within
        timeout_s of now, on any thread) and merges every shard's top `retrieval.k` for each vector. Each shard
        answers through its `structure` (`candidates` of its rows per query, default its own depth, scored
        exactly) unless `exact` or there is none: see `answered_by`. Given `allow_partial` false, it raises
        ShardsUnavailable naming the first shard that failed or did not answer in time; true, it lists that
        shard as missing. `filter`: each shard searches exactly among the rows it matches (its structure
        unused), so the merge is the exact filtered answer; `fields`: the metadata fields each hit carries."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        k = retrieval.k
        options = {} if self.answered_by(retrieval) == "exact" else {
            "structure": self.structure, "candidates": retrieval.candidates}
        if retrieval.filter is not None:
            options["filter"] = retrieval.filter
        if retrieval.fields is not None:
            options["fields"] = tuple(retrieval.fields)
        deadline = time.monotonic() + self.timeout_s
        pending, failures = [], {}
        for shard, client, build in zip(self.shards, self.clients, self.builds):  # all sent before any is awaited
            try:
                pending.append(client.search(vectors, k, build, **options))
            except Exception as error:  # noqa: BLE001 - any failure of a shard is that shard's
                pending.append(None)
                failures[shard] = error
        return functools.partial(self._collect, pending, failures, deadline, len(vectors), k)

    def _collect(self, pending: list, failures: dict, deadline: float, queries: int, k: int,
                 allow_partial: bool) -> tuple[list[list[Hit]], dict]:
        answered: dict[str, list[list[ShardHit]]] = {}
        for shard, client, call in zip(self.shards, self.clients, pending):
            if call is None:
                continue
            try:
                answered[shard] = call.result(timeout_s=max(FETCH_GRACE_S, deadline - time.monotonic()))
            except Exception as error:  # noqa: BLE001
                failures[shard] = error
                cancel = getattr(call, "cancel", None)
                if cancel is not None:
                    cancel()
        if failures and (not allow_partial or not answered):
            shard, error = next(iter(failures.items()))
            client = self.clients[self.shards.index(shard)]
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            advice = "; send allow_partial: true for the other shards' results" if not allow_partial else ""
            what = (f"did not answer within {self.timeout_s:g} s" if isinstance(error, TimeoutError)
                    else "failed")  # a dead replica, or an error in the shard: not a matter of waiting longer
            raise ShardsUnavailable(f"shard {shard} ({client.name}) {what} ({reason.rstrip(': ')}){advice}")
        hits = []
        for position in range(queries):
            merged = merge_top_k([found[position] for found in answered.values()], k)
            hits.append([Hit(id=h.id, text=h.text, score=h.score, rank=rank) if h.fields is None else
                         HitWithFields(id=h.id, text=h.text, score=h.score, rank=rank, fields=h.fields)
                         for rank, h in enumerate(merged, 1)])
        return hits, {"answered": [s for s in self.shards if s in answered],
                      "missing": [s for s in self.shards if s not in answered]}


class ShardedEngine(SearchEngine):
    """A SearchEngine whose retrieval is the shards' top-k merged (each list scored exactly, found by a scan
    or through the shards' structures: ShardedSearcher.answered_by); encoding and reranking run here.
    It serves dense retrieval only (bm25 and hybrid are NotServable) and does not reload in place."""

    @classmethod
    def over(cls, clients: Sequence[ShardClient], *, device: str = "auto", query_max_tokens: int | None = None,
             rerankers: Sequence[Path] = (), backend: Backend | None = None,
             rerank_backend: Backend | None = None, timeout_s: float = 10.0,
             defaults: Defaults = Defaults()) -> "ShardedEngine":
        """The engine over `clients`, all N shards of one build in any order (ValueError otherwise), with
        the encoder their manifests name, loaded here; `timeout_s`: how long a search waits for a shard."""
        first = Manifest.model_validate(clients[0].describe()["manifest"])
        encoder = encoder_for(first, device, query_max_tokens, backend)
        searcher = ShardedSearcher(clients, encoder, timeout_s, defaults)
        loaded = load_rerankers(rerankers, device, reranker_backend(first, device, backend, rerank_backend))
        return cls(searcher, loaded, query_max_tokens, backend)

    # A search waits for the shards' answers (Run.wait): the served engine waits off the model thread,
    # which encodes the next batch meanwhile, so a silent shard holds only the requests that need it.
    waits = True

    def candidate_cards(self) -> list[dict]:
        """Each shard's recall card (with `shard`, "i/N") of the structures every shard carries."""
        return self._searcher.cards

    def _send(self, searcher: "ShardedSearcher", queries: Sequence[str], vectors: np.ndarray | None,
              plan: SearchPlan) -> Fetch:
        fetch = searcher.scatter(vectors, plan.retrieval)
        return functools.partial(fetch, plan.allow_partial)

    def evaluate_filter(self, plan: SearchPlan) -> None:
        """Nothing: each shard evaluates a filter over its own rows, in its own process."""

    def followed(self) -> None:
        """None: shards are not followed in place (see prepare)."""

    write_sequence = 0  # shards take no writes

    def prepare(self, index_dir: Path):
        raise ReloadError("a sharded service does not reload in place: build the new shards and deploy them "
                          "(python -m service --ray ... --shards NEW...), then move traffic")

    def describe(self) -> dict:
        """SearchEngine's description, with what the shards hold together in place of the first's."""
        searcher: ShardedSearcher = self._searcher
        return {
            **super().describe(),
            "index_dir": ", ".join(searcher.index_dirs),
            "count": searcher.count,
            "index_bytes": sum(m.files[name].bytes for m in searcher.manifests for name in (INDEX_FILE, PASSAGES_FILE)),
            "built_at": max(m.built_at for m in searcher.manifests),
            "bm25": False,
            "shards": searcher.shards,
            "fields": searcher.field_types,
        }
