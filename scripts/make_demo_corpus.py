"""Generate the small demo retrieval collection in data/demo/.

The collection is built from the docstrings of the Python standard library
(PSF licence), read by parsing the .py sources with ``ast`` (nothing is
imported). For every documented public function, method or class the
docstring is split into a summary (its first sentence) and a body (the rest).
The summary becomes a query, the qualified name plus body becomes a passage,
and the query's only relevant passage is the one it was split from. Other
documented definitions (too short, or with an unusable or duplicated summary)
are added as distractor passages holding their whole docstring.

Usage:
    python scripts/make_demo_corpus.py --out data/demo
"""

import argparse
import ast
import random
import re
import sysconfig
from collections import Counter
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo",
             "ensurepip", "site-packages", "pydoc_data"}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")
SEED, N_PASSAGES, N_QUERIES, N_HEAD_QUERIES, HEAD_LINES = 13, 3000, 400, 100, 300
MIN_SUMMARY_WORDS, MAX_SUMMARY_WORDS, MIN_BODY_WORDS, MAX_BODY_WORDS = 4, 40, 15, 200
MIN_DISTRACTOR_WORDS = 8


def module_files(stdlib):
    """Yield (dotted module name, path) for public stdlib modules, sorted."""
    for path in sorted(stdlib.rglob("*.py")):
        parts = list(path.relative_to(stdlib).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and not SKIP_DIRS & set(path.relative_to(stdlib).parts) and all(
                p.isidentifier() and not p.startswith("_") for p in parts):
            yield ".".join(parts), path


def definitions(body, prefix):
    """Yield (qualified name, node) for public defs, descending into classes
    and module-level if/try blocks but not into function bodies."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name.startswith("_"):
                continue
            yield f"{prefix}.{node.name}", node
            if isinstance(node, ast.ClassDef):
                yield from definitions(node.body, f"{prefix}.{node.name}")
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                yield from definitions(block, prefix)


def drop_doctests(text):
    """Remove doctest examples: '>>>' lines, continuations and their output."""
    kept, in_example = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(">>>"):
            in_example = True
        elif not line.strip():
            in_example = False
        if not in_example:
            kept.append(line)
    return "\n".join(kept)


def split_docstring(doc):
    """Return (summary sentence, body) with whitespace collapsed."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", drop_doctests(doc))
                  if p.strip()]
    if not paragraphs:
        return "", ""
    first = SENTENCE_END.split(paragraphs[0], maxsplit=1)
    return first[0], " ".join(first[1:] + paragraphs[1:])


def is_clean_summary(summary):
    """A usable query: a plain-English sentence, not a signature or a lead-in."""
    n_words = len(summary.split())
    return (MIN_SUMMARY_WORDS <= n_words <= MAX_SUMMARY_WORDS and summary.isascii()
            and summary[0].isalpha() and not summary.endswith(":")
            and "->" not in summary and "=>" not in summary
            and not re.match(r"[\w.]+\(", summary))


def collect_entries(stdlib):
    """Return (query sources, distractors), each a sorted list of
    (qualified name, passage text, summary or None)."""
    docs, seen = [], set()
    for module, path in module_files(stdlib):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for qname, node in definitions(tree.body, module):
            doc = ast.get_docstring(node, clean=True)  # inspect.cleandoc
            if doc and qname not in seen:
                seen.add(qname)
                docs.append((qname, *split_docstring(doc)))
    summaries = Counter(s.lower() for _, s, _ in docs)
    bodies = Counter(b for _, _, b in docs)
    sources, rest = [], []
    for qname, summary, body in docs:
        words = body.split()
        if (is_clean_summary(summary) and len(words) >= MIN_BODY_WORDS and body.isascii()
                and summaries[summary.lower()] == 1 and bodies[body] == 1
                and summary.lower() not in body.lower()):
            sources.append((qname, " ".join(words[:MAX_BODY_WORDS]), summary))
        else:  # distractor: the whole docstring, summary included
            rest.append((qname, " ".join(f"{summary} {body}".split()[:MAX_BODY_WORDS])))
    # A distractor must be real text, unique, and must not contain a query.
    query_texts = [s.lower() for _, _, s in sources]
    texts = Counter(t for _, t in rest)
    distractors = [(q, t, None) for q, t in rest
                   if len(t.split()) >= MIN_DISTRACTOR_WORDS and t.isascii() and texts[t] == 1
                   and not any(s in t.lower() for s in query_texts)]
    return sorted(sources), sorted(distractors)


def build(sources, distractors, rng):
    """Sample passages and queries; order the corpus so the passages relevant
    to the first N_HEAD_QUERIES queries lie within the first HEAD_LINES lines."""
    pool = sorted(sources + distractors)
    passages = rng.sample(pool, min(N_PASSAGES, len(pool)))
    queries = rng.sample([p for p in passages if p[2] is not None], N_QUERIES)
    others = [p for p in passages if p not in set(queries[:N_HEAD_QUERIES])]
    rng.shuffle(others)
    head = queries[:N_HEAD_QUERIES] + others[:HEAD_LINES - N_HEAD_QUERIES]
    rng.shuffle(head)
    ordered = head + others[HEAD_LINES - N_HEAD_QUERIES:]
    pid = {e: f"p{i:05d}" for i, e in enumerate(ordered, 1)}
    return ordered, queries, pid


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/demo"))
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="standard library source folder (default: this interpreter's)")
    args = parser.parse_args()

    sources, distractors = collect_entries(args.stdlib)
    ordered, queries, pid = build(sources, distractors, random.Random(SEED))
    args.out.mkdir(parents=True, exist_ok=True)
    files = {
        "corpus.tsv": [f"{pid[e]}\t{e[0]}: {e[1]}" for e in ordered],
        "queries.tsv": [f"q{i:04d}\t{e[2]}" for i, e in enumerate(queries, 1)],
        "qrels.txt": [f"q{i:04d} 0 {pid[e]} 1" for i, e in enumerate(queries, 1)],
    }
    for name, lines in files.items():
        (args.out / name).write_text("".join(f"{line}\n" for line in lines),
                                     encoding="utf-8", newline="\n")
    avg = sum(len(f"{q}: {t}".split()) for q, t, _ in ordered) / len(ordered)
    print(f"{len(sources)} query sources + {len(distractors)} distractors -> "
          f"{len(ordered)} passages (avg {avg:.1f} words), {len(queries)} queries, "
          f"{len(queries)} qrels in {args.out}")


if __name__ == "__main__":
    main()
