"""``python -m core.eval --checkpoint DIR --tasks T [T ...] [--include-path DIR ...] [--num-fewshot N] [--held-out NAME=FILE ...] [--limit N] [--json OUT] [--log-samples FILE]``

Evaluates a plait checkpoint folder or export (whatever ``core.generate`` reads) offline with the
code the ``downstream`` monitor runs in the loop (:mod:`core.loop.evaluation`): multiple-choice tasks
(``eval/<task>/acc``, ``acc_norm`` per character, ``acc_norm_tokens``, ``gold_ll``, standard errors
``acc_stderr``, ``acc_norm_stderr``), rolling tasks (``word_perplexity``, ``byte_perplexity``,
``bits_per_byte``) and bits per byte on held-out text or token ``.bin`` files (``eval/<name>/bpb``).
A task is an lm-evaluation-harness task name or ``.yaml`` (read by lm-evaluation-harness's own task
loading, ``--include-path`` folders searched too) or a plait ``.jsonl`` task file. Prints a table;
writes files only where asked: the metrics as JSON (``--json OUT``), one JSON line per multiple-choice
example (``--log-samples FILE``). Tasks are read and checked before the model is loaded: bad input is
one line naming the task (or ``file:line``), exit 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from core.contract.errors import ArgumentParser, ConfigError, DataError, PlaitError, exit_bad_input
from core.loop import evaluation


def codec_byte_length(codec, ids: list[int]) -> int:
    """The UTF-8 bytes ``ids`` stand for, decoded by the checkpoint's tokenizer."""
    return len(codec.decode(ids).encode("utf-8"))


def held_out_pairs(values: list[str]) -> dict[str, Path]:
    pairs: dict[str, Path] = {}
    for v in values:
        name, sep, file = v.partition("=")
        if not sep or not name or not file:
            raise ConfigError(f"--held-out {v!r}: expected NAME=FILE")
        if name in pairs:
            raise ConfigError(f"--held-out: {name!r} named twice")
        pairs[name] = Path(file)
    return pairs


def table(metrics: dict[str, float]) -> str:
    """``task | acc | acc_norm | ...`` rows, one per task or held-out file."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        _, name, metric = key.split("/", 2)
        rows.setdefault(name, {})[metric] = value

    def order(m: str) -> tuple[bool, str, str]:  # SUMS and bpb first, each standard error after its metric
        base = m.removesuffix("_stderr")
        return base not in evaluation.SUMS and base not in ("bpb", "loss"), base, m

    columns = sorted({m for r in rows.values() for m in r}, key=order)
    width = max(len(n) for n in rows) if rows else 4
    lines = [f"{'name':<{width}}  " + "  ".join(f"{c:>15}" for c in columns)]
    for name, r in rows.items():
        lines.append(f"{name:<{width}}  " + "  ".join(f"{r[c]:>15.6f}" if c in r else f"{'':>15}" for c in columns))
    return "\n".join(lines)


def evaluate_checkpoint(
    checkpoint: Path,
    tasks: list[str],
    held_out: dict[str, Path],
    *,
    limit: int = 0,
    batch_size: int = 16,
    max_len: int = 0,
    held_out_tokens: int = 0,
    tokenizer: str | None = None,
    device: str | None = None,
    samples: list[dict] | None = None,
    include_path: list[str] | None = None,
    num_fewshot: int | None = None,
    fewshot_seed: int = evaluation.harness_tasks.DEFAULT_FEWSHOT_SEED,
) -> dict[str, float]:
    """Every metric of ``tasks`` (:func:`core.loop.evaluation.read_tasks`, with ``include_path``,
    ``num_fewshot`` and ``fewshot_seed``) and ``held_out`` on ``checkpoint`` (one process); ``samples``:
    extended with a record per multiple-choice example (:func:`core.loop.evaluation.task_samples`)."""
    from core.cli.generate import load, pick_device
    from core.cli.text_codec import Codec, TokenizerRecord, resolve

    read = evaluation.read_tasks(  # before the model: bad input first
        tasks, limit, key="--tasks", include_path=include_path or [], num_fewshot=num_fewshot, fewshot_seed=fewshot_seed
    )
    both = sorted({t.name for t in read} & set(held_out))
    if both:
        raise ConfigError(f"{both[0]!r} names both a task and a --held-out file")
    loaded = load(checkpoint)
    record = TokenizerRecord(resolve(tokenizer, [Path.cwd()], "--tokenizer"), None, "--tokenizer") if tokenizer else loaded.tokenizer
    if record is None:
        raise DataError(f"{checkpoint}: no tokenizer recorded (not in state.json, nor in the data section or a meta.json); pass --tokenizer SPEC")
    codec = Codec(record)
    spec = loaded.spec
    longest = evaluation.resolve_max_len(max_len, getattr(spec, "max_seq_len", None), "--max-len")
    held = [
        evaluation.read_held_out(name, p, codec.encode, lambda ids: codec_byte_length(codec, ids), spec.vocab_size, held_out_tokens)
        for name, p in held_out.items()
    ]
    prepared = evaluation.prepare(read, held, codec.encode, codec.eos_id, spec.vocab_size)

    dev = pick_device(device)
    scorer = evaluation.Scorer(loaded.model.to(dev), longest, dev, batch_size)
    return evaluation.evaluate_locally(prepared, scorer, samples)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m core.eval", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--checkpoint", required=True, type=Path, help="a committed checkpoint folder or an export made by core.export")
    p.add_argument(
        "--tasks",
        nargs="*",
        default=[],
        help="lm-evaluation-harness task names or .yaml files (multiple_choice, loglikelihood_rolling), or plait .jsonl task files",
    )
    p.add_argument(
        "--include-path",
        "--include_path",
        nargs="*",
        default=[],
        metavar="DIR",
        help="folders of lm-evaluation-harness task .yaml files, searched for --tasks names (default: none)",
    )
    p.add_argument(
        "--num-fewshot",
        "--num_fewshot",
        type=int,
        default=None,
        help="few-shot examples per context of lm-evaluation-harness tasks (default: the task's own, else 0)",
    )
    p.add_argument(
        "--fewshot-seed",
        type=int,
        default=evaluation.harness_tasks.DEFAULT_FEWSHOT_SEED,
        help="seed of lm-evaluation-harness's few-shot sampler (default: %(default)s, lm_eval's)",
    )
    p.add_argument("--held-out", nargs="*", default=[], metavar="NAME=FILE", help="held-out text or token .bin files: eval/NAME/bpb")
    p.add_argument("--limit", type=int, default=0, help="examples per task, the first ones; 0: all (default: %(default)s)")
    p.add_argument("--held-out-tokens", type=int, default=0, help="tokens read from each .bin file; 0: all (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=0, help="longest sequence scored; 0: the model's max_seq_len, else 2048 (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="bytes | hf:PATH/tokenizer.json | tiktoken:PATH (default: the one the checkpoint recorded)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the metrics as JSON here (default: no file)")
    p.add_argument(
        "--log-samples",
        type=Path,
        default=None,
        metavar="FILE",
        help="write one JSON line per task example here (choices' log-likelihoods, acc, acc_norm), per rolling document (its log-likelihood, words, bytes) (default: no file)",
    )
    args = p.parse_args(argv)
    try:
        for flag, value, low in (
            ("--limit", args.limit, 0),
            ("--num-fewshot", 0 if args.num_fewshot is None else args.num_fewshot, 0),
            ("--held-out-tokens", args.held_out_tokens, 0),
            ("--batch-size", args.batch_size, 1),
            ("--max-len", args.max_len, 0),
        ):
            if value < low:
                raise ConfigError(f"{flag} must be >= {low}, got {value}")
        if not args.tasks and not args.held_out:
            raise ConfigError("--tasks and --held-out are both empty: nothing to evaluate")
        for flag, out in (("--json", args.json), ("--log-samples", args.log_samples)):
            if out is not None and not out.parent.is_dir():
                raise ConfigError(f"{flag} {out}: folder {out.parent} does not exist")
        samples: list[dict] | None = [] if args.log_samples is not None else None
        with torch.no_grad():
            metrics = evaluate_checkpoint(
                args.checkpoint,
                args.tasks,
                held_out_pairs(args.held_out),
                limit=args.limit,
                batch_size=args.batch_size,
                max_len=args.max_len,
                held_out_tokens=args.held_out_tokens,
                tokenizer=args.tokenizer,
                device=args.device,
                samples=samples,
                include_path=args.include_path,
                num_fewshot=args.num_fewshot,
                fewshot_seed=args.fewshot_seed,
            )
    except PlaitError as e:
        exit_bad_input(e)
    sys.stdout.write(table(metrics) + "\n")
    if args.json is not None:
        record = {"checkpoint": str(args.checkpoint), "metrics": {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    if args.log_samples is not None:
        with args.log_samples.open("w") as f:
            for sample in samples or []:
                f.write(json.dumps(sample, ensure_ascii=False, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
