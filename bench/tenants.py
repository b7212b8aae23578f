"""Issue 75's fourth attack, replayed against `python -m service`: what a hostile tenant or a careless operator
could take, held or broke, case by case.

    python bench/tenants.py [--work runs/tenants] [--device cpu] [--before CHECKOUT]

300 passages of the shipped demo corpus, half tenant `a`'s and half `b`'s (b's also holding a field `secret_b`
and the word "zebra" in 12 of them), served with SEARCH_WRITES=true, scoped keys A and B and an admin key; then a
writer on a 20 MB tmpfs (mounting one needs root), filled, and its folder and log removed under it. Each case
prints `held` or `broke` with what it saw (fair admission is bench/fair_admission.py's). `--before CHECKOUT`: the
same cases against another checkout's code (served with this one's virtual environment), in a second column. The last line measures what BM25's shared
statistics tell a tenant: A infers the collection's document frequency of a term only B's passages hold, from
three of its own passages and three bm25 searches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import Server  # noqa: E402

KEYS = {"A": ("key-a", ["search", "write"], {"tenant": "a"}), "B": ("key-b", ["search", "write"], {"tenant": "b"}),
        "admin": ("key-admin", ["search", "write", "rerank", "embeddings", "admin"], None)}
TARGET, TARGET_DF = "zebra", 12  # a word only b's passages hold, in this many


def build(work: Path, device: str) -> Path:
    """The two tenants' index (built once into `work`)."""
    index = work / "index"
    if (index / "manifest.json").exists():
        return index
    lines = (ROOT / "data/demo/corpus.tsv").read_text().splitlines()[:300]
    records = []
    for i, line in enumerate(lines):
        pid, text = line.split("\t", 1)[0], line.split("\t")[-1]
        tenant = "a" if i % 2 == 0 else "b"
        record = {"id": pid, "text": text, "tenant": tenant}
        if tenant == "b":
            record["secret_b"] = "confidential"
            if i // 2 < TARGET_DF:
                record["text"] += f" {TARGET}"
        records.append(record)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    subprocess.run([sys.executable, "-m", "index_builder", "build", "--corpus", str(corpus), "--out", str(index),
                    "--device", device, "--overwrite"], check=True, cwd=ROOT)
    return index


def keys_file(path: Path, keys: dict) -> Path:
    path.write_text(json.dumps([{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
                                 "routes": routes, **({"filter": scope} if scope else {})}
                                for name, (key, routes, scope) in keys.items()]))
    return path


def as_key(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name][0]}"}


def message(answer: httpx.Response) -> str:
    json_body = answer.headers.get("content-type", "").startswith("application/json")
    detail = answer.json().get("detail") if json_body else None
    return json.dumps(detail) if detail is not None else answer.text[:200]


def tenant_cases(base: str, keys: Path) -> list[tuple[str, bool, str]]:
    """The cases one writer with keys answers: (case, held, what it saw)."""
    cases = []
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        def post(path, body, key):
            return client.post(path, json=body, headers=as_key(key))

        seen = message(post("/search", {"query": "x", "filter": {"tenantt": "a"}}, "A"))
        cases.append(("1 unknown field's 422 names another tenant's field", "secret_b" not in seen, seen[-90:]))
        seen = message(post("/search", {"query": "x", "fields": ["nope"]}, "A"))
        cases.append(("1 fields: [nope] names another tenant's field", "secret_b" not in seen, seen[-90:]))
        seen = message(post("/passages", {"passages": [{"id": "a-x", "text": "t", "secret_b": 5}]}, "A"))
        cases.append(("1 a type conflict names the other tenant's type", "string" not in seen, seen[-90:]))
        spec = client.get("/openapi.json", headers=as_key("A"))
        cases.append(("1 /openapi.json lists the collection's fields", "secret_b" not in spec.text,
                      f"{spec.status_code}, secret_b {'in' if 'secret_b' in spec.text else 'not in'} it"))
        post("/passages", {"passages": [{"id": "a-plant", "text": "t", "a_customer_acme_corp_contract": "x"}]}, "A")
        seen = message(post("/search", {"query": "x", "filter": {"nope": 1}}, "B"))
        cases.append(("1 a name A planted shows in B's errors", "acme_corp" not in seen, seen[-90:]))
        junk = {f"junk{i:03d}": i for i in range(253)}
        wide = post("/passages", {"passages": [{"id": "a-wide", "text": "junk", **junk}]}, "A")
        lang = post("/passages", {"passages": [{"id": "b-lang", "text": "t", "lang": "en"}]}, "B")
        cases.append(("2 A's 253 fields use up the field cap for B", lang.status_code == 200,
                      f"A's write {wide.status_code}, B's new field {lang.status_code}"))
        for kind, body in [("k 5.5", {"query": "x", "k": 5.5}),
                           ("id 12345", {"passages": [{"id": 12345, "text": "t"}]}),
                           ("id true", {"passages": [{"id": True, "text": "t"}]})]:
            answer = post("/passages" if "passages" in body else "/search", body, "admin")
            saw = f"{answer.status_code} {message(answer)[-60:]}"
            cases.append((f"7 {kind} coerced", answer.status_code == 422, saw))
        twice = client.post("/search", json={"query": "x"},
                            headers=[("Authorization", "Bearer key-admin"), ("Authorization", "Bearer key-a")])
        cases.append(("9 two Authorization headers taken", twice.status_code == 400, str(twice.status_code)))
        before = os.stat(keys)
        revoked = {**KEYS, "A": ("key-z", *KEYS["A"][1:])}
        content = json.dumps(json.loads(keys_file(Path(str(keys) + ".new"), revoked).read_text())).encode()
        with open(keys, "r+b") as handle:
            handle.write(content)
        os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
        still = post("/search", {"query": "x"}, "A").status_code
        cases.append(("4 a key revoked in place (same size, mtime restored) still works", still == 401, str(still)))
        keys.unlink()
        gone = post("/search", {"query": "x"}, "B").status_code
        cases.append(("4 a key of a deleted keys file still works", gone == 401, str(gone)))
        keys_file(keys, KEYS)
    return cases


def second_writer_case(index: Path, checkout: Path, keys: Path) -> tuple[str, bool, str]:
    """8: a second writer on the same folder fails to load; what /ready tells a caller with no key."""
    with Server(index, "cpu", checkout=checkout, writes="true", api_keys_file=str(keys)):
        second = Server(index, "cpu", checkout=checkout, writes="true", api_keys_file=str(keys))
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    ready = httpx.get(f"{second.base}/ready", timeout=2, trust_env=False)
                    if ready.json()["status"] != "loading":
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.3)
        finally:
            second.__exit__()
        told = ready.json().get("detail") or ""
        return ("8 a load error (path, pid) readable without a key", str(index) not in told,
                f"{ready.status_code} detail={told[:60]!r}")


def writer_cases(index: Path, checkout: Path, work: Path) -> list[tuple[str, bool, str]]:
    """5: a full disk under a writer (a 20 MB tmpfs, filled): what a refused write answers, and whether the same
    connection answers next; 6: the index folder and its log removed and copied back under a running writer."""
    disk = work / "disk"
    disk.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        return [("5 a full disk: a refused write", True, f"not run: {mounted.stderr.decode().strip()[:60]}")]
    cases = []
    try:
        served = Path(shutil.copytree(index, disk / "index"))
        with Server(served, "cpu", checkout=checkout, writes="true") as server, \
                httpx.Client(base_url=server.base, timeout=60, trust_env=False) as client:
            filler = disk / "filler"
            descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)  # the disk filled to its last bytes
            try:
                while True:
                    os.write(descriptor, b"\0" * 4096)
            except OSError:
                pass
            finally:
                os.close(descriptor)
            refused = client.post("/passages", json={"passages": [{"id": "full", "text": "no room " * 400}]})
            try:
                after = client.get("/health").status_code
            except httpx.TransportError as error:
                after = type(error).__name__
            is_json = refused.headers.get("content-type", "").startswith("application/json")
            cases.append(("5 a full disk: a refused write is a bare 500, its connection reset",
                          refused.status_code in (503, 507) and is_json and after == 200,
                          f"{refused.status_code} {message(refused)[:50]}; next on the connection: {after}"))
            filler.unlink()
            resumed = client.post("/passages", json={"passages": [{"id": "room", "text": "room again"}]}).status_code
            cases.append(("5 writes resume by themselves once space returns", resumed == 200, str(resumed)))
            log = served.parent / f".{served.name}.writes"
            kept = work / "copy"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(served, kept)
            shutil.rmtree(served)
            log.unlink()
            shutil.copytree(kept, served)
            gone = client.post("/passages", json={"passages": [{"id": "lost", "text": "written after the log went"}]})
            cases.append(("6 a writer whose folder and log were removed keeps acknowledging", gone.status_code != 200,
                          f"{gone.status_code} {message(gone)[:60]}"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    return cases


def bm25_inference(base: str) -> str:
    """What BM25's shared statistics tell tenant A of a term only B's passages hold: its document frequency over
    the collection, from three of A's own passages (u, t and v once in one; v alone in two more) and three bm25
    searches. bm25s's idf is ln(1 + (N - df + 0.5) / (df + 0.5)); one passage's term scores differ by idf alone."""
    u, v, m = "quokkanonce", "wombatnonce", 3
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        client.post("/passages", headers=as_key("A"), json={"passages": [
            {"id": "probe-0", "text": f"{u} {TARGET} {v}"}, *({"id": f"probe-{i}", "text": v} for i in range(1, m))]})

        def score(term: str) -> float:
            hits = client.post("/search", headers=as_key("A"), json={"query": term, "mode": "bm25", "k": 10}).json()
            return next(hit["score"] for hit in hits["results"] if hit["id"] == "probe-0")

        s_u, s_t, s_v = score(u), score(TARGET), score(v)
        total = client.get("/ready", headers=as_key("admin")).json()["index"]["count"]

    def idf(df: float, n: float) -> float:
        return math.log(1 + (n - df + 0.5) / (df + 0.5))

    low, high = float(m), 1e9  # N from idf(v) / idf(u), which falls as N grows
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if idf(m, middle) / idf(1, middle) < s_v / s_u else (low, middle)
    n = (low + high) / 2
    x = math.exp(s_t / s_u * idf(1, n)) - 1
    df = (n + 0.5 - 0.5 * x) / (x + 1)
    return (f"9 BM25 statistics: from 3 passages and 3 searches, A infers N = {n:.1f} (true {total}) and the "
            f"document frequency of {TARGET!r}, a term only B's passages hold: {df:.2f} (true {TARGET_DF + 1}, "
            "A's probe included)")


def run(index: Path, work: Path, checkout: Path) -> tuple[list[tuple[str, bool, str]], str]:
    folder = work / f"served-{hashlib.sha256(str(checkout).encode()).hexdigest()[:8]}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    served = Path(shutil.copytree(index, folder / "index"))
    keys = keys_file(folder / "keys.json", KEYS)
    with Server(served, "cpu", checkout=checkout, writes="true", api_keys_file=str(keys),
                max_concurrent_requests="64") as server:
        cases = tenant_cases(server.base, keys)
        inferred = bm25_inference(server.base)
    cases.append(second_writer_case(served, checkout, keys))
    cases.extend(writer_cases(index, checkout, folder))
    return cases, inferred


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "runs/tenants")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--before", type=Path, help="another checkout to replay the cases against too")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    index = build(args.work, args.device)
    now, inferred = run(index, args.work, ROOT)
    before = run(index, args.work, args.before)[0] if args.before else None
    width = max(len(case) for case, _, _ in now)
    print(f"{'case':<{width}}  {'before':<6}  {'now':<6}  what it saw now")
    for position, (case, held, saw) in enumerate(now):
        then = ("held" if before[position][1] else "broke") if before else "-"
        print(f"{case:<{width}}  {then:<6}  {'held' if held else 'broke':<6}  {saw}")
    print(inferred)
    print(f"{sum(held for _, held, _ in now)} of {len(now)} cases held now"
          + (f", {sum(held for _, held, _ in before)} before" if before else "")
          + f", in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
