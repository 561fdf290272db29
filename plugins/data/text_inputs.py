"""The inputs of a data preparation (``python -m plugins.data.prepare``) and of ``text_stream``:
the ``.txt``, ``.jsonl`` and ``.parquet`` files under the given paths, each with the name its
documents' split is hashed under, and their documents; a bad file is one DataError naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from core.api import DataError, need

SUFFIXES = (".txt", ".jsonl", ".parquet")


def list_inputs(paths: list[str]) -> list[Path]:
    return list(split_keys(paths))


def split_keys(paths: list[str]) -> dict[Path, str]:
    """The input files, in order, each with the name its documents' split is hashed under: the path
    from the folder that holds the ``--input`` argument (``corpus/sub/a.jsonl`` for a file found under
    ``--input corpus``; ``sub/a.jsonl`` for ``--input corpus/sub/a.jsonl``), so the split does not
    depend on the working directory or on how the path is spelled (relative, absolute, ``./``)."""
    files: dict[Path, str] = {}
    for p in map(Path, paths):
        if p.is_dir():
            top = Path(os.path.abspath(p))  # not resolve(): a symlinked folder keeps its own name
            for f in sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES):
                files.setdefault(f, f"{top.name}/{f.relative_to(p).as_posix()}")
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"{p}: unsupported file type {p.suffix!r}; expected {', '.join(SUFFIXES)}")
            absolute = Path(os.path.abspath(p))
            files.setdefault(p, f"{absolute.parent.name}/{absolute.name}")
        else:
            raise DataError(f"{p}: no such file or folder")
    if not files:
        raise DataError(f"no {', '.join(SUFFIXES)} files under {', '.join(paths)}")
    return files


def documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8")
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            text = json.loads(line)[text_field]
                        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                            raise DataError(f"{path}:{n}: not a JSON object with a {text_field!r} string ({type(e).__name__}: {e})") from None
                        if not isinstance(text, str):
                            raise DataError(f"{path}:{n}: {text_field!r} is {type(text).__name__} {str(text)[:40]!r}, expected a string")
                        yield text
        else:
            need("pyarrow.parquet", f"{path}: reading .parquet")
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
                if text_field not in pf.schema_arrow.names:
                    raise DataError(f"{path}: no column {text_field!r}; columns: {', '.join(pf.schema_arrow.names)}")
                batches = pf.iter_batches(columns=[text_field])
                for batch in batches:
                    for t in batch.column(0).to_pylist():
                        if t and not isinstance(t, str):
                            raise DataError(f"{path}: column {text_field!r} holds {type(t).__name__} values, expected strings")
                        if t:
                            yield t
            except DataError:
                raise
            except (pa.ArrowException, OSError, ValueError) as e:  # not a parquet file, corrupt pages
                raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def check_parquet(files: list[Path], text_field: str) -> None:
    """Every parquet input is readable and has the text column: refused before any tokenization."""
    parquets = [f for f in files if f.suffix == ".parquet"]
    if not parquets:
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{parquets[0]}: reading .parquet needs pyarrow (pip install pyarrow, or plait[data])") from None
    for f in parquets:
        try:
            names = pq.ParquetFile(f).schema_arrow.names
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"{f}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if text_field not in names:
            raise DataError(f"{f}: no column {text_field!r} (--text-field); columns present: {', '.join(names) or 'none'}")
