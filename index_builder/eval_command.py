"""`python -m index_builder eval`: the rows to compare (modes, each exact and through each candidate
structure, each reranked), searched, scored and printed as one table. From Python: `evaluate_index(
EvalOptions(index, queries, qrels, ...))` returns the table, the runs and the lines the command prints."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from index_builder.evaluate import (
    CONSISTENCY_DEPTHS,
    EVAL_MODES,
    RECALL_AGAINST_EXACT,
    Ensemble,
    Remembered,
    consistency_factor,
    eval_rows,
    format_table,
    recall_against_exact,
    rerank_runs,
)
from models.reranker import load_reranker
from retrieval.evaluation import metrics, mode_name, retrieve, run_queries
from retrieval.index_format import read_manifest
from retrieval.load_options import LoadOptions
from retrieval.readers import Run, read_qrels, read_queries, read_run, write_run
from retrieval.searcher import MAX_K, Searcher, encoder_for, reranker_backend


def _row_name(folder: Path) -> str:
    """A reranker's name in the table: its folder's, with the training output's for a checkpoint folder."""
    folder = folder.resolve()
    return f"{folder.parent.name}-{folder.name}" if folder.name.startswith("checkpoint-") else folder.name


@dataclass
class EvalOptions:
    """What `eval` measures (its flags, docs/evaluation.md): the index, its queries and judgements, and the rows."""

    index: Path
    queries: Path
    qrels: Path
    modes: list[str] | None = None  # default: every mode the index has (EVAL_MODES)
    exact: bool = False  # exact rows only, even where the index carries candidate structures
    filter: str | None = None  # a filter's JSON: every row searches among the passages it keeps
    runs_dir: Path | None = None  # a TREC run file per row, written here
    compare: Path | None = None  # a run to measure the dense run's consistency with
    k: int = MAX_K
    rerank: list[Path] | None = None  # reranker folders: each row reranked by each
    depth: int = 100  # passages reranked
    retrieval_weight: list[float] | None = None
    ensemble: bool = False
    query_max_tokens: int | None = None
    device: str = "auto"
    backend: str | None = None
    rerank_backend: str | None = None


@dataclass
class EvalReport:
    """`eval`'s answer: each row's measures by row name (None where a row has no such measure), each row's
    run, and the lines the command prints (the table among them)."""

    table: dict[str, dict[str, float | None]] = field(default_factory=dict)
    runs: dict[str, Run] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def evaluate_index(options: EvalOptions) -> EvalReport:
    """Every row's measures in one table; ValueError for bad input."""
    names = [_row_name(folder) for folder in options.rerank or []]
    if options.ensemble and len(names) < 2:
        raise ValueError("--ensemble averages two rerankers or more: give --rerank two folders or more")
    if options.ensemble and Ensemble.name in names:
        raise ValueError(f"--ensemble: a reranker folder would be the ensemble's table row {Ensemble.name!r}; rename it")
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ValueError(f"--rerank: two folders would both be the table row {duplicated[0]!r}; rename one")
    if options.compare and options.modes and "dense" not in options.modes:
        raise ValueError("--compare measures the dense run's consistency with a run: add dense to --modes")
    if options.rerank and options.depth > MAX_K:
        raise ValueError(f"--depth must be at most {MAX_K}, got {options.depth}")
    weights = list(dict.fromkeys(options.retrieval_weight or [0.0]))
    if any(not 0 <= weight <= 100 for weight in weights):
        raise ValueError(f"--retrieval-weight: each weight must be from 0 to 100, got {weights}")
    if options.retrieval_weight and not options.rerank:
        raise ValueError("--retrieval-weight blends a reranker's score with the first stage's: add --rerank")
    if options.rerank_backend and not options.rerank:
        raise ValueError("--rerank-backend is the backend a reranker runs on: add --rerank")
    queries = read_queries(options.queries)
    qrels = read_qrels(options.qrels)
    reference = read_run(options.compare) if options.compare else None
    manifest = read_manifest(options.index)
    encoder = encoder_for(manifest, options.device, options.query_max_tokens, options.backend)
    searcher = Searcher(options.index, encoder, load=LoadOptions(device=options.device))
    report = EvalReport()
    runs, table, say = report.runs, report.table, report.lines.append
    only = _eval_filter(searcher, options.filter, say)  # {"filter": the parsed filter}, or {}
    rerank_backend = reranker_backend(manifest, options.device, options.backend, options.rerank_backend)
    rerankers = {name: load_reranker(folder, device=options.device, backend=rerank_backend)
                 for name, folder in zip(names, options.rerank or [])}
    if options.ensemble:  # last: it reads the scores its members' rows kept
        rerankers = {name: Remembered(reranker) for name, reranker in rerankers.items()}
        rerankers[Ensemble.name] = Ensemble(list(rerankers.values()))
    modes = options.modes or (list(EVAL_MODES) if searcher.bm25 is not None else ["dense"])
    structures = [] if options.exact else list(searcher.structures)
    unused = [record.kind for record in searcher.manifest.candidates if record.kind not in searcher.structures]
    if unused and not options.exact:
        print(f"note: every row is exact: the index's candidate structures ({', '.join(unused)}) serve the CPU "
              f"only, and --device {options.device} searches on a GPU", file=sys.stderr)
    rows = eval_rows(modes, structures)
    approximate = any(row.structure for row in rows)

    def record(name: str, run: Run, seconds: float, exact_name: str | None) -> None:
        runs[name] = run
        table[name] = {**metrics(qrels, run), "ms/query": 1000 * seconds / len(queries)}
        if approximate:  # exact rows have no recall against themselves
            table[name][RECALL_AGAINST_EXACT] = None if exact_name is None else recall_against_exact(
                run, runs[exact_name])
        if options.runs_dir:
            options.runs_dir.mkdir(parents=True, exist_ok=True)
            write_run(options.runs_dir / f"{name}.run", run, tag=name)

    if queries:  # the model's first forward pass is slower: keep it out of the first row's ms/query
        searcher.batch_search([next(iter(queries.values()))], 10)
    for row in rows:
        exact_row = None if row.structure is None else row.mode
        started = time.perf_counter()
        run = run_queries(searcher, queries, options.k, **row.retrieval, **only)
        record(row.name, run, time.perf_counter() - started, exact_row)
        if rerankers:
            started = time.perf_counter()
            retrieved = retrieve(searcher, queries, max(options.k, options.depth), **row.retrieval, **only)
            retrieval_seconds = time.perf_counter() - started
        members_seconds = 0.0  # the ensemble costs what its members' scoring cost, which it reads again
        for name, reranker in rerankers.items():
            started = time.perf_counter()
            reranked = rerank_runs(reranker, queries, retrieved, options.depth, options.k, weights,
                                   label=f"{row.name}+{name}")
            rerank_seconds = time.perf_counter() - started
            if name == Ensemble.name:
                rerank_seconds += members_seconds
            members_seconds += rerank_seconds
            seconds = retrieval_seconds + rerank_seconds
            for weight, run in reranked.items():
                record(f"{row.name}+{name}{_blended(weight)}", run, seconds,
                       exact_row and f"{exact_row}+{name}{_blended(weight)}")
    say(format_table(table))
    default = searcher.request(options.k)  # what a search naming no mode runs on this index
    say(f"default: {mode_name(default.mode, default.fusion)}, what a search naming no mode runs on this index")
    if approximate:
        _describe_structures(searcher, structures, options.k, say)
    comparisons = {"bm25": runs["bm25"]} if "dense" in runs and "bm25" in runs else {}
    if reference is not None:
        comparisons[options.compare.name] = reference
    for name, other in comparisons.items():
        depth = min(max(map(len, other.values()), default=0), max(CONSISTENCY_DEPTHS))  # the reference's own
        values = ", ".join(f"C(dense, {n}) = {consistency_factor(runs['dense'], other, n):.4f}"
                           for n in CONSISTENCY_DEPTHS if n <= options.k)
        if values:
            say(f"consistency of dense with {name}'s top {depth}: {values}")
    through = f", exact and through {', '.join(structures)}" if approximate else ""
    blends = [weight for weight in weights if weight]
    if rerankers and blends:
        say("ROW+RERANKER~wW: the reranked passages ordered by z(reranker) + W * z(first stage), each score "
              "standardised over them (SEARCH_RERANK_RETRIEVAL_WEIGHT W).")
    if options.ensemble:
        say("ROW+ensemble: the reranked passages ordered by the mean of the rerankers' standardised scores, "
              "its ms/query the sum of theirs.")
    reranked = f", {len(options.rerank)} rerankers at depth {options.depth}" if rerankers else ""
    say(f"evaluated {len(queries)} queries x {len(modes)} modes at k={options.k}{through}{reranked}")
    return report


def _blended(weight: float) -> str:
    """A reranked row's suffix for its retrieval weight: none for the reranker's order alone."""
    return f"~w{weight:g}" if weight else ""


def _eval_filter(searcher: Searcher, given: str | None, say) -> dict:
    """--filter's JSON parsed and checked against the index's fields (ValueError saying what is wrong), as
    the rows' retrieval option; a line says how many passages it keeps. {} without one."""
    if given is None:
        return {}
    try:
        spec = json.loads(given)
    except json.JSONDecodeError as error:
        raise ValueError(f"--filter: not valid JSON ({error})") from None
    parsed = searcher.parse_filter(spec)
    # The collection's passages: the generation's rows its writes leave (a sealed index's), then the written ones.
    matching = searcher.generation_rows(parsed).count + int(searcher.segment.matching(parsed).sum())
    say(f"filter {parsed.spec}: {matching} of {searcher.count} passages match; every row searches among them")
    return {"filter": parsed}


def _describe_structures(searcher: Searcher, structures: list[str], k: int, say) -> None:
    """What the approximate rows and their recall column are, and where --k makes them search deeper than a
    short request would."""
    depths = {kind: searcher.structures[kind].depth for kind in structures}
    say("MODE: exact, every vector scanned. MODE@KIND: the dense list from KIND's candidates ("
          + ", ".join(f"{kind} {depth}" for kind, depth in depths.items())
          + " per query, at least the list's depth), each scored exactly.")
    say(f"{RECALL_AGAINST_EXACT}: the share of the exact row's top 10 that the row's top 10 holds, averaged "
          "over the queries.")
    shallow = [f"{kind}'s {depth}" for kind, depth in depths.items() if depth < k]
    if shallow:
        say(f"note: --k {k} is past {', '.join(shallow)} candidates, so those rows rescore {k} per query, as a "
              f"request of k={k} is answered; a --k of at most the candidates measures the top 10 that a request "
              "of k=10 gets.")
