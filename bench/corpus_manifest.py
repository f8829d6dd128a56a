"""The corpus's frozen split: every case, its split and batch, and a hash of its files.

`tests/fixtures/corpus/MANIFEST.json` is written once when a batch is added and checked by
`tests/unit/test_corpus_manifest.py`, so that no case moves between `dev/` and `test/`, and no
case's logs or label change, without the change showing in the manifest's diff. A case's hash is
SHA-256 over its files' relative paths and bytes, in sorted order.

Run: .venv/bin/python -m bench.corpus_manifest [--write] [--corpus tests/fixtures/corpus]
(without --write: check, exit 1 and name each difference when the corpus and manifest differ).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from bench.accuracy import CORPUS, LABEL_FILE, SPLITS, batch_of

MANIFEST = "MANIFEST.json"


def case_hash(case: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in case.rglob("*") if p.is_file()):
        rel = path.relative_to(case).as_posix().encode()
        digest.update(len(rel).to_bytes(4, "big") + rel)
        data = path.read_bytes()
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def build(corpus: Path) -> dict[str, dict[str, str]]:
    """case name -> {split, batch, sha256}, over every case folder of every split."""
    cases: dict[str, dict[str, str]] = {}
    for split in SPLITS:
        folder = corpus / split
        if not folder.is_dir():
            continue
        for case in sorted(p for p in folder.iterdir() if p.is_dir() and (p / LABEL_FILE).is_file()):
            cases[case.name] = {"split": split, "batch": batch_of(case.name), "sha256": case_hash(case)}
    return cases


def differences(corpus: Path) -> list[str]:
    """What differs between the corpus and its manifest, one sentence each (empty: they agree)."""
    path = corpus / MANIFEST
    if not path.is_file():
        return [f"{path}: no manifest (write one with python -m bench.corpus_manifest --write)"]
    frozen: dict[str, dict[str, str]] = json.loads(path.read_text())["cases"]
    now = build(corpus)
    out = [f"{name}: in the manifest ({frozen[name]['split']}) but not in the corpus" for name in frozen.keys() - now]
    out += [f"{name}: in {now[name]['split']}/ but not in the manifest" for name in now.keys() - frozen]
    for name in sorted(frozen.keys() & now.keys()):
        was, is_ = frozen[name], now[name]
        if was["split"] != is_["split"]:
            out.append(f"{name}: frozen in {was['split']}/, now in {is_['split']}/")
        elif was["sha256"] != is_["sha256"]:
            out.append(f"{name}: its files changed since the manifest was written")
    return sorted(out)


def write(corpus: Path) -> Path:
    path = corpus / MANIFEST
    cases = build(corpus)
    counts = {s: sum(c["split"] == s for c in cases.values()) for s in SPLITS}
    path.write_text(json.dumps({"counts": counts, "cases": cases}, indent=1, sort_keys=True) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write or check the corpus's frozen split manifest.")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="the folder holding dev/ and test/")
    parser.add_argument("--write", action="store_true", help="write the manifest instead of checking it")
    args = parser.parse_args(argv)
    if args.write:
        print(f"wrote {write(args.corpus)}")
        return 0
    diffs = differences(args.corpus)
    for line in diffs:
        print(line)
    if not diffs:
        print("the corpus matches its manifest")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
