"""Benchmark: what counting a generation's growth costs, beside writing its objects.

A published tree is counted (``growth.tree_blobs`` and ``growth.new_bytes``: every
file hashed without being written, then looked up in the repository) before its new
blobs are written (``LineageCache.hash_files``, as the pipeline does). Three trees,
each into a fresh bare repository, median of N rounds each:

* **one 8 MiB file** of random data: the default generation budget, filled;
* **2,000 files of 4 KiB**: the budget filled with small files;
* **64 MiB of random data** in 16 files: a tree the budget refuses.

Each row prints the count's time, the write's time and count / write. Target: the
count at most 0.5x the write (it hashes; the write hashes and compresses).

Run: ``.venv/bin/python bench/bench_growth.py [--rounds 5]`` from the repository
root. A measurement, not a test: exits 0 whether the target is met or not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pygit2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_note, median, verdict

from worker.instrument import growth
from worker.instrument.decoder import TreeEntry
from worker.instrument.gitrepo import LineageCache

TARGET = 0.5
TREES = {
    "one 8 MiB file": (1, 8 * 1024**2),
    "2,000 files of 4 KiB": (2000, 4096),
    "64 MiB in 16 files": (16, 4 * 1024**2),
}


def make_tree(root: Path, files: int, size: int) -> list[TreeEntry]:
    root.mkdir()
    decoded = []
    for n in range(files):
        path = f"f{n:05d}"
        (root / path).write_bytes(os.urandom(size))
        decoded.append(TreeEntry(path=path, kind="file", executable=False, size=size, target=None))
    return decoded


def one_round(scratch: Path, files: int, size: int) -> tuple[float, float]:
    """Seconds to count the tree's growth, and to write its blobs, in a fresh repository."""
    with tempfile.TemporaryDirectory(dir=scratch) as where:
        base = Path(where)
        pygit2.init_repository(str(base / "repo"), bare=True)
        cache = LineageCache(base / "repo", str(base / "repo"))
        decoded = make_tree(base / "tree", files, size)
        start = time.perf_counter()
        added = growth.new_bytes(cache.repo, growth.tree_blobs(decoded, base / "tree"))
        counted = time.perf_counter() - start
        assert added >= files * size
        start = time.perf_counter()
        cache.hash_files([base / "tree" / e.path for e in decoded])
        return counted, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per tree")
    args = parser.parse_args()
    print(machine_note())
    with tempfile.TemporaryDirectory(prefix="bench-growth-") as scratch:
        for name, (files, size) in TREES.items():
            rounds = [one_round(Path(scratch), files, size) for _ in range(args.rounds)]
            count = median(r[0] for r in rounds)
            write = median(r[1] for r in rounds)
            print(
                f"{name:<22} count {count * 1000:7.1f} ms   write {write * 1000:7.1f} ms   "
                f"{verdict(count / write, TARGET, higher_is_better=False)}"
            )


if __name__ == "__main__":
    main()
