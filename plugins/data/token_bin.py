"""``token_bin``: nanoGPT's flat binary token files.

``<path>/train.bin`` and ``<path>/val.bin`` hold token ids back to back
(uint16, or uint32 when the vocabulary needs it), optionally described by
``<path>/meta.json``. Without a dtype in ``meta.json``, a uint16 file whose
every other token over its first 65536 tokens is at most the high half a uint32
id of the model's vocabulary can have (3, or ``(vocab_size - 1) >> 16`` for a
larger vocabulary), while the others are not, is refused: that is uint32 data
read as uint16 (``[low, high, ...]``); ``dtype = "uint32"`` (or a ``meta.json``
that says which) settles it. With ``check_ids``, an id at or above the model's vocabulary, or the
``vocab_size`` ``meta.json`` declares, is refused before training. Sample ``i`` is a function of ``(seed, i)`` alone, so
every world size sees the same batches:

- ``order = "random"`` (nanoGPT's way): the window of ``seq_len + 1`` tokens
  starting at ``mix_seed(seed, split, i) % (n - seq_len - 1)``. Never runs out.
- ``order = "epochs"``: the file is cut into ``(n - 1) // seq_len`` windows
  (each overlapping the next by the one label token) and every epoch visits
  each exactly once, in an order shuffled per epoch by a keyed permutation.
  Sample ``i`` is window ``permute(i mod N, N, key(seed, epoch))``. The source
  runs out after ``N`` samples, which a ``mixture`` can wrap or stop on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from core.api import DataError, IndexedSource, TokenizerSpec, log, mix_seed, option, permute

SPLIT_IDS = {"train": 0, "val": 1}
SCAN_CHUNK = 1 << 24
WIDTH_SAMPLE = 1 << 16  # uint16 tokens looked at for the uint32-read-as-uint16 check
HIGH_HALF_MAX = 3  # the high uint16 half of a uint32 id below 262144 (the least the check allows, whatever the vocabulary)


@dataclass
class TokenBinOptions:
    path: str = option("", "folder holding train.bin / val.bin", path=True)
    dtype: Literal["auto", "uint16", "uint32"] = option("auto", "token dtype; auto reads meta.json, else uint16")
    train_file: str = option("train.bin", "training file name inside path", inside=True)
    val_file: str = option("val.bin", "validation file name inside path", inside=True)
    check_ids: bool = option(True, "scan the files for ids >= the model's vocabulary before training")
    order: Literal["random", "epochs"] = option("random", "random: windows at random offsets (never runs out); epochs: each window once per epoch, shuffled")

    def check(self) -> None:
        if not self.path:
            raise ValueError("path is required: the folder with train.bin and val.bin")


class TokenBin(IndexedSource):
    def __init__(self, options: TokenBinOptions) -> None:
        self.options = options
        self.root = Path(options.path)
        self._arrays: dict[str, TokenFile] = {}
        self._meta: dict | None = None

    # -- checks before training ---------------------------------------------
    def meta(self) -> dict:
        if self._meta is None:
            f = self.root / "meta.json"
            try:
                meta = json.loads(f.read_text()) if f.is_file() else {}
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{f}: not valid JSON ({e})") from None
            except OSError as e:
                raise DataError(f"{f}: unreadable ({e})") from None
            if not isinstance(meta, dict):
                raise DataError(f"{f}: expected a JSON object with dtype and vocab_size, got {type(meta).__name__}")
            self._meta = meta
        return self._meta

    def dtype(self) -> np.dtype:
        meta_dtype = self.meta().get("dtype")
        if self.options.dtype != "auto":
            if meta_dtype and meta_dtype != self.options.dtype:
                raise DataError(f"{self.root / 'meta.json'}: dtype is {meta_dtype}, but [data].dtype = {self.options.dtype!r}")
            return np.dtype(self.options.dtype)
        if meta_dtype not in (None, "uint16", "uint32"):
            raise DataError(f"{self.root / 'meta.json'}: dtype {meta_dtype!r}; expected uint16 or uint32")
        return np.dtype(meta_dtype or "uint16")

    def file(self, split: str) -> Path:
        return self.root / (self.options.train_file if split == "train" else self.options.val_file)

    def has_split(self, split: str) -> bool:
        return split in SPLIT_IDS and self.file(split).is_file()

    def validate(self, vocab_size: int, seq_len: int) -> None:
        if not self.root.is_dir():
            what = "is a file" if self.root.exists() else "does not exist"
            raise DataError(f"[data] token_bin: path {self.root} {what}; expected a folder holding train.bin (python -m plugins.data.prepare makes one)")
        dtype = self.dtype()
        meta_vocab = self.meta().get("vocab_size")
        if isinstance(meta_vocab, int) and meta_vocab > vocab_size:
            raise DataError(f"{self.root / 'meta.json'}: vocab_size {meta_vocab} exceeds the model's vocabulary {vocab_size}")
        for split in ("train", "val"):
            f = self.file(split)
            if split == "val" and not f.is_file():
                continue  # validation is optional
            if not f.is_file():
                raise DataError(f"[data] token_bin: {f} not found")
            size = f.stat().st_size
            if size == 0:
                raise DataError(f"{f} is empty")
            if size % dtype.itemsize:
                raise DataError(f"{f}: size {size} bytes is not a multiple of {dtype.name} ({dtype.itemsize} bytes); wrong dtype?")
            n = size // dtype.itemsize
            self.check_count(f, split, n)
            if n < seq_len + 2:
                raise DataError(f"{f} holds {n} tokens, fewer than data.seq_len + 2 = {seq_len + 2}")
            if dtype == np.uint16 and self.meta().get("dtype") is None:
                self.check_width(f, n, vocab_size)
            if self.options.check_ids:
                self.check_ids(f, dtype, n, vocab_size)
            self._arrays[split] = TokenFile(f, dtype)  # the size and time the run holds the file to

    def check_ids(self, f: Path, dtype: np.dtype, n: int, vocab_size: int) -> None:
        """Every id in ``f`` below the model's vocabulary and below the ``vocab_size`` that ``meta.json``
        declares (ids past it are not the tokenizer's: another tokenizer's file, or the wrong dtype).
        One pass over the file (docs/benchmarks.md: its cost on a multi-GB file)."""
        arr = np.memmap(f, dtype=dtype, mode="r")
        top = max(int(arr[i : i + SCAN_CHUNK].max()) for i in range(0, n, SCAN_CHUNK))
        declared = self.meta().get("vocab_size")
        if isinstance(declared, int) and not isinstance(declared, bool) and top >= declared:
            raise DataError(
                f"{f} holds token id {top}, not below the vocab_size {declared} that {self.root / 'meta.json'} declares: "
                "a file of another tokenizer, or of another dtype? prepare it again (python -m plugins.data.prepare)"
            )
        if top >= vocab_size:
            raise DataError(f"{f} holds token id {top}, not below the model's vocabulary {vocab_size}")

    def check_count(self, f: Path, split: str, n: int) -> None:
        """A file named as ``prepare`` writes it must hold the tokens ``meta.json`` counts for its split:
        a copy cut short (at a whole token) or a file rebuilt beside an old ``meta.json`` is refused."""
        counts = self.meta().get("tokens")
        expected = counts.get(split) if isinstance(counts, dict) else None
        if f.name != f"{split}.bin" or not isinstance(expected, int) or isinstance(expected, bool) or expected == n:
            return
        raise DataError(
            f"{f} holds {n} tokens, but {self.root / 'meta.json'} says tokens.{split} = {expected}: "
            f"{'truncated' if n < expected else 'not the file meta.json describes'}? prepare it again "
            "(python -m plugins.data.prepare) or copy the folder whole"
        )

    def check_width(self, f: Path, n: int, vocab_size: int) -> None:
        """uint32 token files read as uint16 look like ``[low, high, low, high, ...]`` (little-endian):
        every odd position holds the high half of an id, at most ``(vocab_size - 1) >> 16`` for ids of
        the model's vocabulary (0 below 65536, 3 below 262144, 4 for a vocabulary of 300,000). Refused
        when every odd position of the first tokens is that small and the even ones are not: text
        tokenised as uint16 is never so."""
        k = min(n, WIDTH_SAMPLE) // 2 * 2
        if k < 128:
            return  # too few tokens to tell
        head = np.fromfile(f, dtype=np.uint16, count=k)
        high, low = int(head[1::2].max()), int(head[0::2].max())
        if high <= max(HIGH_HALF_MAX, (vocab_size - 1) >> 16) < low:
            which = "0" if high == 0 else f"at most {high}"
            raise DataError(
                f"{f}: every other uint16 token is {which} in the first {k} tokens: this looks like uint32 data read as uint16 "
                f'(ids below {(high + 1) << 16}); set [data].dtype = "uint32" (or write "dtype" in {self.root / "meta.json"})'
            )

    def end_of_document_id(self) -> int | None:
        """``meta.json``'s ``eos_id`` (``prepare`` ends every document with it), or None."""
        eos = self.meta().get("eos_id")
        return eos if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0 else None

    def tokenizer(self) -> TokenizerSpec | None:
        """The tokenizer ``meta.json`` names (``prepare`` records it, with its sha256 and EOS), its file found
        from the working directory or the data folder; None when it names none, or (said once) when its
        file is not found with that sha256: training needs no tokenizer, ``core.export`` then asks for one."""
        from core.api import TOKENIZER_KINDS, tokenizer_fingerprint

        meta, where = self.meta(), self.root / "meta.json"
        spec, eos, want = meta.get("tokenizer"), meta.get("eos_id"), meta.get("tokenizer_fingerprint")
        if not isinstance(spec, str) or not spec:
            return None
        eos = eos if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0 else None
        kind, _, path = spec.partition(":")
        if kind == "bytes" and not path:
            return TokenizerSpec("bytes", eos)
        if kind not in TOKENIZER_KINDS or not path:
            log.warn(f"{where}: tokenizer {spec!r} is not bytes, hf:PATH or tiktoken:PATH; checkpoints record no tokenizer", once=f"token_bin tok {where}")
            return None
        file = Path(path).expanduser()
        candidates = [file] if file.is_absolute() else [Path.cwd() / file, self.root / file]
        for candidate in candidates:
            if candidate.is_file() and (not isinstance(want, str) or tokenizer_fingerprint(candidate) == want):
                return TokenizerSpec(f"{kind}:{candidate.resolve()}", eos)
        log.warn(
            f"{where}: tokenizer {spec!r} not found{' with its recorded sha256' if isinstance(want, str) else ''} (looked at "
            f"{', '.join(map(str, candidates))}); checkpoints record no tokenizer: core.export and core.generate will need --tokenizer",
            once=f"token_bin tok {where}",
        )
        return None

    # -- samples -------------------------------------------------------------
    def array(self, split: str) -> "TokenFile":
        if split not in self._arrays:
            self._arrays[split] = TokenFile(self.file(split), self.dtype())
        return self._arrays[split]

    def num_tokens(self, split: str) -> int:
        return len(self.array(split))

    def tokens_per_epoch(self) -> int:
        """Tokens in the training file: the logged ``epoch`` is tokens seen over this (either order)."""
        return self.num_tokens("train")

    def fingerprint(self) -> str:
        """The training file's size, dtype and CRC-32 of its first and last MiB, and the tokenizer's
        fingerprint from ``meta.json``: cheap on any size, and it changes when the file is rebuilt."""
        import zlib

        f, edge = self.file("train"), 2**20
        size = f.stat().st_size
        with open(f, "rb") as fh:
            crc = zlib.crc32(fh.read(edge))
            fh.seek(max(0, size - edge))
            crc = zlib.crc32(fh.read(edge), crc)
        tokenizer = str(self.meta().get("tokenizer_fingerprint", ""))[:12]
        return f"{f.name} {size} bytes {self.dtype().name} crc32 {crc:08x}" + (f" tokenizer {tokenizer}" if tokenizer else "")

    def epoch_samples(self, seq_len: int, split: str) -> int | None:
        if self.options.order == "random":
            return None
        return (self.num_tokens(split) - 1) // seq_len

    def sample(self, index: int, seq_len: int, split: str) -> np.ndarray:
        arr = self.array(split)
        if self.options.order == "random":
            start = mix_seed(self.seed, SPLIT_IDS[split], index) % (len(arr) - seq_len - 1)
        else:
            windows = (len(arr) - 1) // seq_len
            epoch, position = divmod(index, windows)
            start = permute(position, windows, mix_seed(self.seed, SPLIT_IDS[split], epoch)) * seq_len
        return arr.read(start, seq_len + 1)


class TokenFile:
    """One token file, read a window at a time with ``pread`` on a descriptor held open, never mapped:
    a file truncated under a running job would kill every rank with SIGBUS on a mapped page, where
    here it is one line. Each read also compares the file's size and modification time with those it
    had when first opened, so a file rewritten in place (same size, other tokens) is refused too,
    rather than read half old, half new. A file replaced by a rename is read as it was (the descriptor
    holds the old one). Picklable: a loader worker opens the file again and holds it to the same size
    and time. The cost per read: docs/benchmarks.md (bench/data_checks.py)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self.fd, self.pid = -1, -1
        self.size, self.mtime_ns = -1, -1
        self.open()

    def open(self) -> None:
        self.fd, self.pid = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), os.getpid()
        st = os.fstat(self.fd)
        if self.size < 0:
            self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        else:  # a worker's own descriptor: the file must still be the one the run started with
            self.check(st.st_size, st.st_mtime_ns)

    def __len__(self) -> int:
        return self.size // self.dtype.itemsize

    def __getstate__(self) -> dict:
        return {**self.__dict__, "fd": -1, "pid": -1}

    def __del__(self) -> None:
        if self.fd >= 0 and self.pid == os.getpid():
            try:
                os.close(self.fd)
            except OSError:
                pass

    def check(self, size: int, mtime_ns: int) -> None:
        if size != self.size:
            what = "truncated" if size < self.size else "grown"
            raise DataError(f"{self.path} changed under the run: {what} from {self.size} to {size} bytes; the run reads a file as it was at its start")
        if mtime_ns != self.mtime_ns:
            raise DataError(
                f"{self.path} changed under the run: rewritten in place (its modification time moved, size {size} bytes kept); "
                "the run reads a file as it was at its start"
            )

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` as int64. Raises DataError if the file changed."""
        if self.pid != os.getpid():
            self.open()
        want = count * self.dtype.itemsize
        try:
            data = os.pread(self.fd, want, start * self.dtype.itemsize)
            st = os.fstat(self.fd)
        except OSError as e:
            raise DataError(f"{self.path}: unreadable under the run ({e.strerror or e})") from None
        self.check(st.st_size, st.st_mtime_ns)
        if len(data) != want:  # the size matched a moment ago: cut and restored between the read and the check
            raise DataError(f"{self.path} changed under the run: {len(data)} of {want} bytes read at token {start}")
        return np.frombuffer(data, dtype=self.dtype).astype(np.int64)
