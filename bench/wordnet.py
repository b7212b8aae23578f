"""A real text collection for recall on real embeddings: WordNet's synset glosses as a TSV corpus.

    apt-get install wordnet-base      # Debian's WordNet 3.0 database, /usr/share/wordnet
    python bench/wordnet.py runs/wordnet/corpus.tsv

One passage a synset (about 117,000): id `POS-OFFSET` (n-00001740), text `word, word: gloss`. Encode it
with the builder (`python -m index_builder build --corpus runs/wordnet/corpus.tsv --out runs/wordnet/index`),
then measure the candidate structures on its vectors (`python bench/candidates.py --index runs/wordnet/index`).
"""

import sys
from pathlib import Path

WORDNET = Path("/usr/share/wordnet")
PARTS = {"noun": "n", "verb": "v", "adj": "a", "adv": "r"}


def glosses(part: str):
    """(id, text) of each synset of data.PART, in the file's order."""
    for line in (WORDNET / f"data.{part}").read_text(encoding="latin-1").splitlines():
        if line.startswith("  ") or "|" not in line:  # the licence header; a synset always has a gloss
            continue
        head, gloss = line.split("|", 1)
        fields = head.split()
        words = [fields[4 + 2 * i].replace("_", " ") for i in range(int(fields[3], 16))]
        yield f"{PARTS[part]}-{fields[0]}", f"{', '.join(words)}: {' '.join(gloss.split())}"


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/wordnet.py OUT.tsv")
    if not (WORDNET / "data.noun").is_file():
        print(f"bench/wordnet.py: {WORDNET} has no WordNet: apt-get install wordnet-base", file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with out.open("w", encoding="utf-8") as handle:
        for part in PARTS:
            for pid, text in glosses(part):
                handle.write(f"{pid}\t{text}\n")
                count += 1
    print(f"wrote {count:,} WordNet glosses to {out}")


if __name__ == "__main__":
    main()
