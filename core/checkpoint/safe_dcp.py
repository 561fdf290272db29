"""DCP storage that never runs code from a checkpoint, and that checksums what it writes.

:class:`SafeFileSystemReader` is the only reader plait uses (resume,
``checkpoint.initial_load``, ``core.export``, ``core.report``). Stock DCP
unpickles ``.metadata`` with :mod:`pickle` and loads non-tensor ("bytes")
items with ``torch.load`` with its weights-only guard turned off: a crafted
checkpoint could run anything. Here ``.metadata`` goes through an unpickler that resolves only the
classes DCP metadata is made of, and bytes items through
``torch.load(weights_only=True)``; anything else is a :class:`CheckpointError`
naming the file and the class.

:class:`HashingFileSystemWriter` is DCP's file writer that also computes the
checksum (:mod:`core.checkpoint.folders`) of every shard while writing it; the
checksums of all ranks reach rank 0 through DCP's own gather of write
results, so the commit manifest gets them without reading the shards again.
"""

from __future__ import annotations

import enum
import io
import pickle
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from core.contract.errors import CheckpointError
from core.runtime import watchdog
from core.runtime.durable_io import Checksum

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Everything a FileSystemWriter's .metadata pickle refers to (torch 2.11 to 2.13), besides torch dtypes.
ALLOWED_GLOBALS: dict[str, set[str]] = {
    _DCP_METADATA: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals of :data:`ALLOWED_GLOBALS` and torch dtypes."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):  # how Python 3.12 (and some 3.11 builds) pickle an enum member
            return self._enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.source} refers to {module}.{name}, which DCP metadata never holds: refusing to load it")

    def _enum_member(self, cls: Any, name: Any) -> enum.Enum:
        """``getattr(cls, name)`` for a member ``name`` of an allowed enum class, and nothing else."""
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
            return cls[name]
        raise CheckpointError(f"{self.source} asks for getattr({cls!r}, {name!r}), which is no enum member DCP metadata holds: refusing to load it")


def load_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint folder ``path``, unpickled through the allow-list."""
    file = path / METADATA_FILE
    try:
        with file.open("rb") as f:
            metadata = _MetadataUnpickler(f, str(file)).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any damage to the file
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{file} is not readable DCP metadata: {type(e).__name__}: {first[0] if first else ''}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file} is not DCP metadata (it holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():  # every shard a file of this folder, nothing outside it
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointError(f"{file} names the shard file {name!r}: expected a file name inside {path}, refusing to read it")
    return metadata


_REFUSED = re.compile(r"GLOBAL ([\w.]+)")


def load_bytes_item(data: io.BytesIO, source: str) -> Any:
    """A non-tensor item of a shard, through ``torch.load(weights_only=True)``."""
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _REFUSED.search(str(e))
        what = found.group(1) if found else str(e).splitlines()[0]
        raise CheckpointError(f"{source} holds {what}, which plait does not load from a checkpoint (weights_only)") from None
    except Exception as e:  # noqa: BLE001 - any damage to the item
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{source}: unreadable item: {type(e).__name__}: {first[0] if first else ''}") from None


class _SafeBytesPlanner:
    """Wraps DCP's load planner: bytes items are loaded safely here, then handed on re-pickled by us."""

    def __init__(self, planner: Any, reader: SafeFileSystemReader) -> None:
        self._planner = planner
        self._reader = reader

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        info = self._reader.storage_data[read_item.storage_index]
        source = f"{Path(self._reader.path) / info.relative_path} (item {read_item.dest_index.fqn!r})"
        obj = load_bytes_item(value, source)
        clean = io.BytesIO()
        torch.save(obj, clean)  # only objects weights_only accepted, pickled by torch itself
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        watchdog.alive()  # each tensor read is progress: a long load is no stall
        self._planner.commit_tensor(read_item, tensor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with allow-listed metadata and ``weights_only`` bytes items."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: plait never writes them
            raise CheckpointError(f"checkpoint {self.path}: per-rank DCP metadata is not supported")
        metadata = load_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # set just above
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        return super().read_data(plan, _SafeBytesPlanner(planner, self))  # type: ignore[arg-type]  # a LoadPlanner by delegation


# --- writing ---------------------------------------------------------------------


class _ChecksummingStream(io.RawIOBase):
    """A write-only file that feeds every byte written to a :class:`Checksum`."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.checksum = Checksum()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self.raw.write(b)  # a buffered file writes all of b, or raises
        self.checksum.update(b)  # each block is progress (core.runtime.watchdog.alive): a long save is no stall
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        # DCP fsyncs fileno() before it closes the stream: flush first, or the fsync misses the
        # tail still in the file object's buffer.
        self.raw.flush()
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes, while the file is still open
            self.raw.close()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, str] = {}  # file name -> checksum, for files this process wrote

    @contextmanager
    def create_stream(self, path: Any, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            wrapped = _ChecksummingStream(stream)
            yield wrapped
            self.checksums[Path(path).name] = wrapped.checksum.hexdigest()


@dataclass
class _ChecksummedStorageInfo:
    """A write result's storage info with its file's checksum, on its way to rank 0."""

    info: _StorageInfo
    file_checksum: str


class HashingFileSystemWriter(_FileSystemWriter):
    """DCP's file writer (no staging of its own: async saves keep DCP's default stager)
    that checksums each shard while writing it. After the save, on the coordinator
    (rank 0), :attr:`checksums` maps every rank's shard file names to their checksums."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()
        self.checksums: dict[str, str] = {}

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()  # FileSystemWriter writes synchronously
        sums: dict[str, str] = self.fs.checksums  # type: ignore[attr-defined]  # our _ChecksummingFileSystem
        tagged = [
            WriteResult(
                index=r.index,
                size_in_bytes=r.size_in_bytes,
                storage_data=_ChecksummedStorageInfo(r.storage_data, sums[r.storage_data.relative_path]),
            )
            for r in results
        ]
        done: Future[list[WriteResult]] = Future()
        done.set_result(tagged)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                tagged = r.storage_data
                self.checksums[tagged.info.relative_path] = tagged.file_checksum
                plain[-1].append(WriteResult(index=r.index, size_in_bytes=r.size_in_bytes, storage_data=tagged.info))
        super().finish(metadata, plain)


# --- loading -----------------------------------------------------------------------


def load(state: dict[str, Any], path: Path, process_group: Any = None) -> None:
    """``dcp.load`` of ``state`` from checkpoint folder ``path`` through the safe reader;
    any failure (on any rank: DCP gathers them) is one CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), process_group=process_group, no_dist=process_group is None)
    except (Exception, CheckpointException) as e:
        raise load_error(path, e) from None


def load_error(path: Path, error: BaseException) -> CheckpointError:
    """One line for a failed load: ours as it is, DCP's first rank's failure otherwise."""
    failures = getattr(error, "failures", None)
    if failures:
        error = failures[min(failures)][0]
    if isinstance(error, CheckpointError):
        return error
    text = str(error).strip().splitlines()
    return CheckpointError(f"checkpoint {path} could not be loaded: {type(error).__name__}: {text[0] if text else ''}")
