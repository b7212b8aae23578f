"""`python -m index_builder {build,update,merge,ann,eval,convert-cranfield}`; bad input exits 2 with a one-line
reason."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from dataclasses import fields
from pathlib import Path

from index_builder.ann import AnnOptions, add_structures
from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.build_update import build_update, check_updatable, index_encoder
from index_builder.compact import compact_index
from index_builder.convert_cranfield import convert_cranfield
from index_builder.corpus_file import check_corpus_file
from index_builder.eval_command import EvalOptions, evaluate_index
from index_builder.evaluate import EVAL_MODES
from index_builder.merge import merge_shards
from index_builder.update import ChangeOptions, apply_changes
from models.backends import BACKENDS
from models.encoder import BiEncoder
from retrieval import out_lock
from retrieval.candidates.recall import RECALL_SAMPLE, RECALL_THRESHOLD
from retrieval.candidates.registry import KINDS, params_by_name
from retrieval.corpus import DEFAULT_MAX_PASSAGE_BYTES
from retrieval.fields import MAX_FIELDS
from retrieval.index_format import IndexFormatError, read_manifest
from retrieval.readers import InputFileError
from retrieval.searcher import MAX_K, EncoderMismatch
from retrieval.sharding import Shard, expand_shard_dirs, shard_folder

LOCAL_RAY = "local"  # `--ray` with no address: ray.init()'s own choice
# OSError and sqlite3.Error cover a full disk too: the build's partial folder stays for a resume.
USAGE_ERRORS = (BuildError, InputFileError, IndexFormatError, EncoderMismatch, OSError, sqlite3.Error, ValueError)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value:g}")
    return value


def _add_ann_flags(parser: argparse.ArgumentParser) -> None:
    """The structure's parameters, shared by `ann` and `build --ann`."""
    for name, (param, kinds) in params_by_name().items():
        default = f" (default {param.default})" if param.default else ""
        raises = "; raises recall" if param.raises_recall else ""
        parser.add_argument(param.flag, type=_positive, metavar="N", dest=_dest(name),
                            help=f"{', '.join(kinds)}: {param.help}{default}{raises}")
    depths = "; ".join(f"{kind.name}: {kind.depth_text()}" for kind in KINDS.values())
    parser.add_argument("--candidates", type=_positive, metavar="N",
                        help=f"candidates rescored exactly per query by default ({depths}); raises recall")
    parser.add_argument("--queries", type=Path, metavar="FILE",
                        help="measure recall on these queries (TSV qid<TAB>query or BEIR JSONL) instead of "
                        f"{RECALL_SAMPLE} held-out passages (each searched with itself excluded)")
    parser.add_argument("--sample", type=_positive, default=RECALL_SAMPLE, metavar="N",
                        help=f"held-out passages recall is measured on (default {RECALL_SAMPLE})")
    parser.add_argument("--recall-threshold", type=_fraction, default=RECALL_THRESHOLD, metavar="R",
                        help="warn when the measured recall@10 is under this, naming the flag that raises it "
                        f"(default {RECALL_THRESHOLD})")


def _dest(param: str) -> str:
    """The argparse attribute of a structure parameter's flag."""
    return f"param_{param}"


def _ann_options(args: argparse.Namespace, kind: str) -> AnnOptions:
    given = {name: getattr(args, _dest(name)) for name in params_by_name() if getattr(args, _dest(name)) is not None}
    return AnnOptions(kind, given, candidates=args.candidates, queries=args.queries, sample=args.sample,
                      recall_threshold=args.recall_threshold, device=args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m index_builder", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="encode a TSV/JSONL corpus into an index directory")
    build.add_argument("--corpus", type=Path, required=True, help="TSV id<TAB>text, or JSONL {id|_id, [title], text}")
    build.add_argument("--out", type=Path, required=True, help="index directory to create")
    build.add_argument("--model", type=Path, help="Hugging Face checkpoint directory (default: packaged MiniLM)")
    build.add_argument("--batch-size", type=_positive, default=64, help="passages per forward pass")
    build.add_argument("--chunk-size", type=_positive, default=2048, help="passages per resumable chunk")
    build.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    build.add_argument("--query-max-tokens", type=_positive,
                       help="default: the model's own maximum (max_seq_length, else its positions, at most 512); "
                       "RepBERT's is 20")
    build.add_argument("--passage-max-tokens", type=_positive,
                       help="default: the model's own maximum, as for queries; RepBERT's is 256")
    build.add_argument("--passage-segment-id", type=int, choices=(0, 1),
                       help="default: 1 (RepBERT), 0 for sentence-transformers models")
    build.add_argument("--query-prefix", metavar="TEXT",
                       help="put before every query, e.g. 'query: ' (default: the model's sentence-transformers "
                       "prompt, else none; '' for none); recorded in the manifest")
    build.add_argument("--passage-prefix", metavar="TEXT",
                       help="put before every passage, e.g. 'passage: ' (default and '' as for --query-prefix)")
    build.add_argument("--skip-bad", action="store_true", help="skip and count malformed lines instead of stopping")
    build.add_argument("--max-passage-bytes", type=_positive, default=DEFAULT_MAX_PASSAGE_BYTES, metavar="N",
                       help="the longest corpus line, in bytes of the raw line (a TSV line or JSONL record, its line "
                       "end aside); a longer one is a bad line (exit 2, or skipped with --skip-bad), read past "
                       f"without being held in memory (default {DEFAULT_MAX_PASSAGE_BYTES} = 1 MiB)")
    build.add_argument("--max-fields", type=_positive, default=MAX_FIELDS, metavar="N",
                       help="the metadata fields an index may declare; a line that would add one more is a bad line "
                       f"(default {MAX_FIELDS})")
    build.add_argument("--overwrite", action="store_true", help="replace an existing --out (atomically)")
    build.add_argument("--restart", action="store_true", help="discard an interrupted build instead of resuming")
    build.add_argument("--update", action="store_true",
                       help="bring the index at --out up to date with --corpus as a new generation: passages whose "
                       "text it holds keep their stored vectors (same encoder only), the rest are encoded, those "
                       "absent from --corpus dropped; BM25 and candidate structures rebuilt")
    build.add_argument("--backend", choices=BACKENDS, default="torch",
                       help="torch, or ONNX Runtime on the CPU (onnx; onnx-int8: int8 weights), recorded in the manifest")
    build.add_argument("--bm25", action=argparse.BooleanOptionalAction, default=True,
                       help="build a BM25 index (bm25s) over the same passages, which hybrid search (the default "
                       "where there is one) needs; --no-bm25: dense only (default: --bm25)")
    build.add_argument("--ann", choices=list(KINDS), metavar="KIND",
                       help=f"also build an approximate candidate structure ({', '.join(KINDS)}; see `ann`)")
    build.add_argument("--shard", type=_shard, metavar="i/N",
                       help="keep only records i, i+N, i+2N, ... (0-based) of the corpus; combine with `merge`")
    build.add_argument("--shards", type=_positive, metavar="N",
                       help="write N shard indexes OUT/shard-0 ... OUT/shard-{N-1} (shard i as --shard i/N "
                       "makes it) from one pass over the corpus, for sharded serving")
    build.add_argument("--if-missing", action="store_true",
                       help="if --out already holds an index, keep it and exit 0 (for one-shot deploy jobs)")
    build.add_argument("--ray", nargs="?", const=LOCAL_RAY, metavar="auto|ADDRESS",
                       help="encode on a pool of Ray actors: alone, the Ray cluster of RAY_ADDRESS or of this "
                       "machine (a new local one if none runs); auto: the one `ray start` runs here; or an address")
    build.add_argument("--workers", type=int, metavar="N",
                       help="with --ray: encoder actors, one model each (default: as many as the cluster holds)")
    build.add_argument("--gpus-per-worker", type=float, metavar="G",
                       help="with --ray: GPUs per actor, e.g. 0.5 for two per GPU; 0 for CPU actors "
                       "(default: 1 where the cluster has GPUs, else 0)")

    _add_ann_flags(build)

    ann = commands.add_parser("ann", help="add an approximate candidate structure to an index, with its recall")
    ann.add_argument("--index", type=Path, required=True,
                     help="index directory (replaced atomically), or the folder of a build --shards N (a structure in "
                     "each shard)")
    ann.add_argument("--kind", choices=list(KINDS), required=True,
                     help="; ".join(f"{kind.name}: {kind.summary}" for kind in KINDS.values())
                     + "; their candidates are rescored exactly from the stored vectors")
    ann.add_argument("--device", default="auto", help="where --queries are encoded: auto, cpu, cuda or cuda:N")
    _add_ann_flags(ann)

    merge = commands.add_parser("merge", help="merge the indexes of `build --shard i/N` jobs into one index")
    merge.add_argument("--shards", type=Path, nargs="+", required=True,
                       help="all N shard index directories (or the folder of a build --shards N)")
    merge.add_argument("--out", type=Path, required=True, help="index directory to create")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing --out (atomically)")
    merge.add_argument("--no-bm25", dest="bm25", action="store_false",
                       help="merge without a BM25 index (default: one over all the passages)")

    evaluate = commands.add_parser("eval", help="run queries through an index and score them against qrels")
    evaluate.add_argument("--index", type=Path, required=True, help="index directory to search")
    evaluate.add_argument("--queries", type=Path, required=True, help="TSV qid<TAB>query or BEIR JSONL")
    evaluate.add_argument("--qrels", type=Path, required=True, help="TREC qrels or BEIR TSV")
    evaluate.add_argument("--modes", nargs="+", choices=list(EVAL_MODES),
                          help="retrieval set-ups to compare (default: all the index supports)")
    evaluate.add_argument("--exact", action="store_true",
                          help="exact rows only (every vector scanned): no row per candidate structure "
                          "(MODE@KIND), which an index carrying structures otherwise gets")
    evaluate.add_argument("--filter", metavar="JSON",
                          help='search only the passages a metadata filter matches, in every row, e.g. '
                          '\'{"source": "pubmed"}\' (the grammar: docs/serving.md#filters)')
    evaluate.add_argument("--runs-dir", type=Path, help="write one TREC run file per row here (ROW.run)")
    evaluate.add_argument("--compare", type=Path, help="a second run (e.g. BM25) for the consistency factor C(f,n)")
    evaluate.add_argument("--k", type=_positive, default=MAX_K, help="results scored per query")
    evaluate.add_argument("--rerank", type=Path, nargs="+", metavar="DIR",
                          help="reranker folders (monoBERT, co-attention, generative, or a Hugging Face "
                          "sequence-classification folder with one logit); each adds a row per retrieval row: "
                          "ROW+DIRNAME (OUTPUT-checkpoint-N for a training checkpoint)")
    evaluate.add_argument("--depth", type=_positive, default=100,
                          help="with --rerank: passages of each mode's list the reranker rescores (default 100)")
    evaluate.add_argument("--retrieval-weight", type=float, nargs="+", metavar="W",
                          help="with --rerank: a row per weight W of the first stage's score blended with the "
                          "reranker's, ROW+DIRNAME~wW, ordered as a request's retrieval_weight orders them "
                          "(0: the reranker alone, the ROW+DIRNAME row; default 0); the reranker reads each list once")
    evaluate.add_argument("--ensemble", action="store_true",
                          help="with two or more --rerank: one more row per retrieval row, ROW+ensemble (and its "
                          "blends), ordered by the mean of the rerankers' standardised scores; each reranker still "
                          "reads each list once")
    evaluate.add_argument("--query-max-tokens", type=_positive, help="override the index's query token limit")
    evaluate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evaluate.add_argument("--backend", choices=BACKENDS,
                          help="encode the queries with this backend (default: the service's: the index's own, or "
                          "onnx for a torch-built index on the CPU where its vectors equal torch's)")
    evaluate.add_argument("--rerank-backend", choices=BACKENDS,
                          help="with --rerank: run a monoBERT reranker on this backend, e.g. onnx-int8 beside torch "
                          "queries (default: --backend where given, else the index's own)")

    update = commands.add_parser("update", help="apply added, replaced and deleted passages to an index")
    update.add_argument("--index", type=Path, required=True, help="index directory (replaced atomically)")
    update.add_argument("--add", type=Path, metavar="FILE",
                        help="a corpus (TSV or JSONL) of new passages and of replacements for passages the index "
                        "holds (same id): replaced ones keep their row, new ones are appended")
    update.add_argument("--delete", type=Path, metavar="IDS_FILE",
                        help="passage ids to delete, one a line (applied before --add; ids not in the index are "
                        "counted and named)")
    update.add_argument("--model", type=Path, help="the index's model folder, where it has moved (default: the "
                        "manifest's)")
    update.add_argument("--batch-size", type=_positive, default=64, help="passages per forward pass")
    update.add_argument("--chunk-size", type=_positive, default=2048, help="passages per resumable chunk of --add")
    update.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    update.add_argument("--skip-bad", action="store_true", help="skip and count malformed lines of --add")
    update.add_argument("--max-passage-bytes", type=_positive, default=DEFAULT_MAX_PASSAGE_BYTES, metavar="N",
                        help="the longest line of --add, as for build")
    update.add_argument("--max-fields", type=_positive, default=MAX_FIELDS, metavar="N",
                        help="the metadata fields the updated index may declare, as for build (at least the index's own)")
    update.add_argument("--restart", action="store_true", help="discard an interrupted build of --add")
    update.add_argument("--no-bm25", dest="bm25", action="store_false",
                        help="write the new generation without a BM25 index (default: one over all its passages)")

    compacting = commands.add_parser("compact", help="merge the writes over HTTP an index holds beside its rows "
                                     "(sealed, or in its log) into a new generation's rows, with no service running")
    compacting.add_argument("--index", type=Path, required=True, help="index directory (replaced atomically)")
    compacting.add_argument("--model", type=Path, help="the index's model folder, where it has moved (default: the "
                            "manifest's)")

    cranfield = commands.add_parser("convert-cranfield", help="SMART-format Cranfield to corpus/queries/qrels files")
    cranfield.add_argument("--data", type=Path, required=True, help="folder with cran.all.1400, cran.qry, cranqrel")
    cranfield.add_argument("--out", type=Path, required=True, help="folder for the corpus, queries and qrels files")
    return parser


def _check_build_flags(args: argparse.Namespace) -> None:
    """BuildError (one line, exit 2) for flags that cannot work together, before anything is loaded."""
    given = [param.flag for name, (param, _) in params_by_name().items() if getattr(args, _dest(name)) is not None]
    given += ["--" + flag for flag in ("candidates", "queries") if getattr(args, flag) is not None]
    if args.ann is None and given:
        raise BuildError(f"{', '.join(given)} need --ann KIND")
    if args.ann is not None:
        _ann_options(args, args.ann).structure_params()
    if args.shard is not None and args.shards is not None:
        raise BuildError("--shard i/N builds one shard, --shards N all of them: pass one of the two")
    if args.update and (args.shard is not None or args.shards is not None or args.if_missing):
        raise BuildError("--update writes one whole index over the one at --out: drop --shard, --shards and "
                         "--if-missing")
    if args.ray is None:
        if args.workers is not None or args.gpus_per_worker is not None:
            raise BuildError("--workers and --gpus-per-worker need --ray")
        return
    if args.shard is not None:
        raise BuildError("--ray encodes the whole corpus on the cluster: drop --shard (or --ray)")
    if args.workers is not None and args.workers < 1:
        raise BuildError(f"--workers must be at least 1, got {args.workers}")
    if args.gpus_per_worker is not None and not args.gpus_per_worker >= 0:
        raise BuildError(f"--gpus-per-worker must be 0 or more, got {args.gpus_per_worker:g}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise BuildError(f"--device {args.device}: with --ray the actors get their GPUs from Ray; "
                         "use auto, cpu (CPU actors) or cuda")
    if args.backend != "torch" and (args.gpus_per_worker or args.device == "cuda"):
        raise BuildError(f"--backend {args.backend} runs on the CPU only: drop --gpus-per-worker and --device cuda "
                         "(its Ray actors are CPU actors)")


def _build(args: argparse.Namespace) -> None:
    _check_build_flags(args)
    if args.if_missing and args.out.exists():
        # A broken folder stops the job rather than being served.
        folders = [shard_folder(args.out, i) for i in range(args.shards)] if args.shards else [args.out]
        manifests = [read_manifest(folder) for folder in folders]
        if args.shards and (shard_folder(args.out, args.shards).exists()
                            or [m.shard for m in manifests] != [f"{i}/{args.shards}" for i in range(args.shards)]):
            raise BuildError(f"{args.out} holds shards of another --shards N, not {args.shards}")
        count = sum(manifest.count for manifest in manifests)
        print(f"kept {args.out}: it already holds an index of {count} passages (--if-missing)")
        return
    options = BuildOptions(
        args.corpus, args.out, args.chunk_size, args.skip_bad, args.overwrite, args.restart, bm25=args.bm25,
        shard=args.shard, shards=args.shards, max_passage_bytes=args.max_passage_bytes, max_fields=args.max_fields,
        ann=[_ann_options(args, args.ann)] if args.ann else [],
    )
    # build_index checks both again; here they fail before a model loads.
    check_corpus_file(args.corpus)
    if args.update:
        check_updatable(args.out, verify_checksums=False)  # checked whole under the lock
    with out_lock.hold(args.out, "build"):
        _build_locked(args, options)


def _build_locked(args: argparse.Namespace, options: BuildOptions) -> None:
    encoder_options = dict(
        batch_size=args.batch_size,
        query_max_tokens=args.query_max_tokens,
        passage_max_tokens=args.passage_max_tokens,
        passage_segment_id=args.passage_segment_id,
        backend=args.backend,
        query_prefix=args.query_prefix,
        passage_prefix=args.passage_prefix,
    )
    if args.ray is None:
        print(_builder(args)(options, BiEncoder(args.model, device=args.device, **encoder_options)).summary())
        return
    from index_builder import ray_build  # only here: a build without --ray never imports Ray

    with ray_build.ray_cluster(None if args.ray == LOCAL_RAY else args.ray):
        with ray_build.RayEncoder({"path": args.model, **encoder_options}, workers=args.workers,
                                  gpus_per_worker=args.gpus_per_worker, device=args.device) as encoder:
            print(f"encoding on Ray: {encoder.workers} actors x {encoder.gpus_per_worker:g} GPUs", file=sys.stderr)
            report = _builder(args)(options, encoder)
    print(report.summary())


def _builder(args: argparse.Namespace):
    return build_update if args.update else build_index


def _update(args: argparse.Namespace) -> None:
    options = ChangeOptions(args.index, args.add, args.delete, args.chunk_size, args.skip_bad, args.restart,
                            args.max_passage_bytes, args.max_fields, args.bm25)
    print(apply_changes(options, lambda manifest: index_encoder(manifest, args.model, args.device,
                                                                args.batch_size)).summary())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "build":
            _build(args)
        elif args.command == "update":
            _update(args)
        elif args.command == "merge":
            print(merge_shards(expand_shard_dirs(args.shards), args.out, args.overwrite, args.bm25).summary())
        elif args.command == "ann":
            for report in add_structures(args.index, _ann_options(args, args.kind)):
                print(report.summary())
        elif args.command == "compact":
            print(compact_index(args.index, args.model))
        elif args.command == "eval":
            options = EvalOptions(**{option.name: getattr(args, option.name) for option in fields(EvalOptions)})
            print(evaluate_index(options))
        else:
            counts = convert_cranfield(args.data, args.out)
            print(f"wrote {args.out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    except USAGE_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
