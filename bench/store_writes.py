"""What the SQLite store's housekeeping costs a write, and what it keeps small.

After every put the store checkpoints its write-ahead log (PASSIVE); after every delete
it gives freed pages back to the file system (incremental vacuum) and truncates the log.
This times puts and deletes with that housekeeping and without it (SQLite's own
autocheckpoint only; the pragmas stay), interleaved, and prints the largest log and
the database's size after the churn.

    .venv/bin/python bench/store_writes.py [--cycles 60] [--size 300000] [--save '']
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _common import Tee, machine_line, markdown_table, median, ms, ratio

from dxserve.server.stores.sqlite import SqliteStore


def _wal(db: Path) -> int:
    wal = db.with_name(db.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def churn(store: SqliteStore, cycles: int, size: int, puts: list[float],
          deletes: list[float], sizes: dict[str, int]) -> None:
    """``cycles`` puts of ``size`` bytes, every other one deleted again."""
    for i in range(cycles):
        content = os.urandom(size)
        start = time.perf_counter()
        store.put(f"f{i}", "export", content, {})
        puts.append(time.perf_counter() - start)
        sizes["wal"] = max(sizes["wal"], _wal(store.path))
        if i % 2:
            start = time.perf_counter()
            store.delete(f"f{i}")
            deletes.append(time.perf_counter() - start)
            sizes["wal"] = max(sizes["wal"], _wal(store.path))
    for i in range(0, cycles, 2):
        store.delete(f"f{i}")
    sizes["db"] = store.path.stat().st_size
    sizes["wal_end"] = _wal(store.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=60)
    parser.add_argument("--size", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--save", default="store-writes-cpu.md", help="'' to not save")
    args = parser.parse_args()
    out = Tee()
    out(f"# SQLite store writes: {args.cycles} puts of {args.size:,} bytes, half deleted\n")
    out(machine_line() + "\n")
    results: dict[str, tuple[list[float], list[float], dict[str, int]]] = {
        name: ([], [], {"wal": 0, "db": 0, "wal_end": 0}) for name in ("housekeeping", "none")
    }
    for r in range(args.rounds):  # interleaved, rotating which goes first
        for name in (("housekeeping", "none") if r % 2 == 0 else ("none", "housekeeping")):
            with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
                store = SqliteStore(tmp)
                if name == "none":
                    store._after_write = lambda *, deleted: None  # type: ignore[method-assign]
                try:
                    churn(store, args.cycles, args.size, *results[name])
                finally:
                    store._conn.close()  # not close(): that checkpoints too
    rows = []
    for name, (puts, deletes, sizes) in results.items():
        rows.append([name, ms(median(puts)), ms(median(deletes)), f"{sizes['wal']:,}",
                     f"{sizes['wal_end']:,}", f"{sizes['db']:,}"])
    out(markdown_table(["store", "put ms (median)", "delete ms (median)", "largest log (bytes)",
                        "log at the end", "database after deleting all"], rows))
    hk, none = results["housekeeping"], results["none"]
    out(f"\nput: {ratio(median(hk[0]), median(none[0]))} of the time without housekeeping; "
        f"delete: {ratio(median(hk[1]), median(none[1]))}")
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
