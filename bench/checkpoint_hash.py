"""Checkpoint checksums: what they cost to write and to verify.

One process, the model and AdamW state of a flavor (one real training step
first), and four measurements:

* hash throughput of the standard library's candidates over (the first
  512 MiB of) the checkpoint's shard, in memory (why plait uses CRC-32);
* DCP saves, sync and async, with DCP's own FileSystemWriter and with plait's
  HashingFileSystemWriter, which checksums each shard while writing it
  (``--repeats`` saves each, interleaved; medians);
* the commit's own added work: checksumming the small files (metadata, JSON);
* verifying the whole checkpoint against its manifest (``core.checkpoint.folders.verify``:
  every file read once; the page cache is warm, as it is right after a save).

    python -m bench.checkpoint_hash --flavor 50m --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

from bench.checkpoint_stall import build
from bench.common import report, table

SAMPLE_BYTES = 512 * 2**20
CANDIDATES = {
    "zlib.crc32": lambda data: zlib.crc32(data),
    "zlib.adler32": lambda data: zlib.adler32(data),
    "hashlib.sha1": lambda data: hashlib.sha1(data).digest(),
    "hashlib.md5": lambda data: hashlib.md5(data).digest(),
    "hashlib.blake2b": lambda data: hashlib.blake2b(data).digest(),
    "hashlib.sha256": lambda data: hashlib.sha256(data).digest(),
}


def throughput(data: bytes, repeats: int) -> list[list]:
    rows = []
    for name, fn in CANDIDATES.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(data)
            times.append(time.perf_counter() - t0)
        rows.append([name, len(data) / statistics.median(times) / 2**30])
    return sorted(rows, key=lambda r: -r[1])


def timed_save(state, path: Path, writer_cls, use_async: bool) -> tuple[float, float]:
    """(seconds the caller was blocked, seconds until written)."""
    import torch.distributed.checkpoint as dcp

    if path.exists():
        shutil.rmtree(path)
    t0 = time.perf_counter()
    if use_async:
        future = dcp.async_save(state, storage_writer=writer_cls(path), no_dist=True)
        stall = time.perf_counter() - t0
        future.result()
    else:
        dcp.save(state, storage_writer=writer_cls(path), no_dist=True)
        stall = time.perf_counter() - t0
    return stall, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="50m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    from torch.distributed.checkpoint import FileSystemWriter

    from core.checkpoint import folders as integrity
    from core.checkpoint.folders import COMMIT_MARKER, verify
    from core.checkpoint.safe_dcp import HashingFileSystemWriter

    tmp = Path(tempfile.mkdtemp(prefix="plait-hash-bench-"))
    try:
        trainer = build(args.flavor, tmp, "cpu")
        ckpt = trainer.checkpointer
        state = ckpt.contents.dcp_state()
        writers = {"DCP FileSystemWriter": FileSystemWriter, "HashingFileSystemWriter": HashingFileSystemWriter}
        saves = {(mode, name): [] for mode in ("sync", "async") for name in writers}
        for _ in range(args.repeats):
            for mode, name in saves:
                saves[(mode, name)].append(timed_save(state, tmp / "bench_save", writers[name], mode == "async"))
        ckpt.save(1000, use_async=False)  # a real commit, manifest included
        folder = tmp / "checkpoints" / "step_000001000"
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        with next(folder.glob("*.distcp")).open("rb") as f:
            shard_bytes = f.read(SAMPLE_BYTES)
        rates = throughput(shard_bytes, args.repeats)
        manifest = integrity.parse_manifest(folder / COMMIT_MARKER)
        small, verifies = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            integrity.manifest_files(folder, COMMIT_MARKER, known={n: manifest.checksums[n] for n in manifest.shards()})
            small.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            verify(folder)
            verifies.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {key: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v)) for key, v in saves.items()}
    verify_s = statistics.median(verifies)
    body = f"Hash throughput over {len(shard_bytes) / 2**20:,.0f} MiB of the checkpoint's shard, in memory, one thread:\n\n"
    body += table(["function", "GiB/s"], rates)
    body += '\n\nSaving (medians; the caller is blocked for "stall", the files are written after "until written"):\n\n'
    body += table(["save", "writer", "stall s", "until written s"], [[mode, name, stall, total] for (mode, name), (stall, total) in med.items()])
    body += "\n\nCommitting and verifying (medians):\n\n"
    body += table(
        ["what", "seconds", "note"],
        [
            ["commit: checksums of the small files", statistics.median(small), "metadata and JSON files, read"],
            ["verify the whole checkpoint", verify_s, f"{size / verify_s / 2**30:.2f} GiB/s, page cache warm"],
        ],
    )
    body += (
        f"\n\nflavor `{args.flavor}`: checkpoint {size / 2**20:,.0f} MiB (fp32 weights + AdamW moments), "
        f"{args.repeats} repeats, one process, local disk. With `async`, the checksums are computed in the "
        "writer's background thread, after the stall. A resume verifies the shards once in all (each rank a "
        "share) before DCP reads them again."
    )
    print(body)
    if not args.no_record:
        report(f"Checkpoint checksums: {args.flavor} on cpu", body, device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
