"""Document masking's cost: loader throughput with and without finding the documents, and the
training step of the llama3 debug model with the causal and the document mask, side by side.

The loaders hand out ids only; the model finds the documents in them on its device
(``model_specs.llama3.model.document_layout``). The first table times token_bin's loader alone and
the loader plus that layout on each batch (what it would cost if done on the host), in alternating
rounds; the second, forward + backward + AdamW steps of both masks on one batch, alternating rounds.

    python -m bench.document_mask --seq-len 512 --micro-batch 8 --batches 200 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.common import REPO, report, table

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def loader_rate(seq_len: int, micro: int, batches: int, with_layout: bool) -> float:
    from core.contract.protocols import LoaderSpec
    from model_specs.llama3.model import document_layout
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    source = TokenBin(TokenBinOptions(path=str(CORPUS)))
    source.validate(512, seq_len)
    eod = source.end_of_document_id()
    assert eod is not None
    it = iter(source.loader(LoaderSpec(seq_len, micro, 1, 0, 1, 42)))
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        ids, _ = next(it)
        if with_layout:
            document_layout(ids, eod)
    return batches * micro * seq_len / (time.perf_counter() - t0)


def step_ms(mask: str, ids, steps: int) -> float:
    import torch

    from model_specs.llama3.spec import Llama3Spec

    spec = Llama3Spec.from_flavor("debug", attention_mask=mask, rope_positions="document" if mask == "document" else "absolute")
    spec.use_end_of_document_id(256)
    torch.manual_seed(0)
    model = spec.build()
    spec.init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(ids, ids).backward()  # warm
    opt.step()
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        model(ids, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--doc-len", type=int, default=128, help="documents of this many tokens in the timed batch")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for layout in (False, True) if r % 2 == 0 else (True, False):
            rates[layout].append(loader_rate(args.seq_len, args.micro_batch, args.batches, layout))
    plain, found = statistics.median(rates[False]), statistics.median(rates[True])
    body = table(
        ["loader (token_bin, one thread)", "median tokens/s"],
        [["ids only (what the loader hands out)", f"{plain:,.0f}"], ["ids + document layout on the host", f"{found:,.0f}"]],
    )
    body += f"\n\nratio {found / plain:.3f}; micro-batch {args.micro_batch} x seq {args.seq_len}, {args.batches} batches per round, {args.rounds} alternating rounds. The loaders hand out ids only; the model finds the documents on its device."
    ids = next(iter(_batches(args.seq_len, args.micro_batch))).clone()
    ids[:, args.doc_len - 1 :: args.doc_len] = 256  # packed documents of doc_len tokens (the plays are longer than a window)
    docs = int((ids == 256).sum())
    times: dict[str, list[float]] = {"causal": [], "document": []}
    for r in range(args.rounds):
        for mask in ("causal", "document") if r % 2 == 0 else ("document", "causal"):
            times[mask].append(step_ms(mask, ids, args.steps))
    causal, document = statistics.median(times["causal"]), statistics.median(times["document"])
    body += "\n\n" + table(["llama3 debug step (forward + backward + AdamW)", "median ms"], [["causal", f"{causal:.1f}"], ["document", f"{document:.1f}"]])
    body += (
        f"\n\ndocument / causal step time: {document / causal:.2f}; one Shakespeare batch with an end-of-document id every {args.doc_len} tokens ({docs} in all), "
        f"SDPA with a boolean block-diagonal causal mask on CPU, {args.steps} steps per round, {args.rounds} alternating rounds, one thread, load average {os.getloadavg()[0]:.1f} at the end."
    )
    print(body)
    if not args.no_record:
        report("Document masking: loader and step cost, debug on cpu", body)
    return 0


def _batches(seq_len: int, micro: int):
    from core.contract.protocols import LoaderSpec
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    source = TokenBin(TokenBinOptions(path=str(CORPUS)))
    source.validate(512, seq_len)
    for ids, _ in source.loader(LoaderSpec(seq_len, micro, 1, 0, 1, 42)):
        yield ids


if __name__ == "__main__":
    sys.exit(main())
