"""A plait checkpoint as an lm-evaluation-harness model: ``plait`` (the optional extra ``eval``).

Importing this module registers the model ``plait`` with lm-evaluation-harness
(``lm_eval.api.registry``). ``plait lm-eval`` (or ``python -m core.cli.lm_eval_model``) is
lm-evaluation-harness's own command line with the model registered::

    plait lm-eval run --model plait --model_args checkpoint=DIR --tasks hellaswag

``--model_args`` takes the keys of :data:`MODEL_ARGS` (``plait lm-eval --help`` prints them with
what plait adds over ``lm_eval``'s own command line: :data:`HELP`). The model and tokenizer are plait's
own; ``loglikelihood`` encodes by :func:`core.loop.evaluation.encode_pair` (lm-evaluation-harness's
rule) and it and ``loglikelihood_rolling`` (:func:`core.loop.evaluation.rolling_requests`) run
:class:`core.loop.evaluation.Scorer`, the code ``core.eval`` and the ``downstream`` monitor run, so a
task's scores equal theirs (``tests/e2e/test_evaluation.py``); ``generate_until`` decodes greedily
(:func:`core.cli.generate.generate`) and cuts the text at the first stop string. Bad input (a missing
checkpoint, an unknown task) is one line, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from core.contract import log
from core.contract.errors import ConfigError, PlaitError, exit_bad_input
from core.loop import evaluation

MODEL_ARGS: dict[str, str] = {  # --model_args key -> what it is (PlaitLM's keyword arguments)
    "checkpoint": "required: a checkpoint folder of a plait run (runs/x/checkpoints/step_N) or an export, loaded as it is, no conversion",
    "tokenizer": "any plait tokenizer, bytes | hf:PATH | tiktoken:PATH (default: the one the checkpoint recorded)",
    "max_len": "longest sequence scored, in tokens (default: the model's max_seq_len, else 2048; as core.eval and the downstream monitor)",
    "batch_size": "sequences per forward (default 16; 'auto': 16)",
    "device": "cpu | cuda | cuda:N; a cuda:N that does not exist falls back to cuda:0, no CUDA to cpu, in one line (default: cuda if any, else cpu)",
}

HELP = "\n".join(
    [
        "plait lm-eval: lm-evaluation-harness's own command line with the model 'plait' registered; every flag",
        "below is the harness's and passes to it unchanged. What plait adds over lm_eval:",
        "  lm-eval run --model plait --model_args checkpoint=DIR[,tokenizer=SPEC][,max_len=N][,batch_size=N][,device=D] --tasks ...",
        *(f"    {key:<10}  {doc}" for key, doc in MODEL_ARGS.items()),
        "  scores equal core.eval's and the downstream monitor's (one scoring rule, lm-evaluation-harness's: docs/evaluation.md)",
        "  bad input (a missing checkpoint, an unknown task, a bad flag value): one line naming it, exit 2",
        "",
    ]
)


def device_that_exists(name: str | None) -> torch.device:
    """``name`` (None: cuda when available, else cpu), a ``cuda``/``cuda:N`` that does not exist replaced,
    in one line, by ``cuda:0`` or, with no CUDA at all, ``cpu``. A name torch does not know: ConfigError."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        asked = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"--device {name!r}: not a torch device ({e}); expected cpu, cuda or cuda:N") from None
    if asked.type != "cuda":
        return asked
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        log.warn(f"device {name}: no CUDA device here; evaluating on cpu")
        return torch.device("cpu")
    if asked.index is not None and asked.index >= count:
        log.warn(f"device {name}: only {count} CUDA device(s) here; evaluating on cuda:0")
        return torch.device("cuda", 0)
    return asked


@register_model("plait")
class PlaitLM(LM):
    def __init__(
        self, checkpoint: str, tokenizer: str | None = None, max_len: int = 0, batch_size: int | str = 16, device: str | None = None, **_: Any
    ) -> None:
        super().__init__()
        from core.cli.generate import load
        from core.cli.text_codec import Codec, TokenizerRecord, resolve
        from core.contract.errors import DataError

        loaded = load(Path(checkpoint))
        record = TokenizerRecord(resolve(tokenizer, [Path.cwd()], "tokenizer"), None, "tokenizer") if tokenizer else loaded.tokenizer
        if record is None:
            raise DataError(f"{checkpoint}: no tokenizer recorded; pass --model_args checkpoint=...,tokenizer=SPEC")
        self.codec = Codec(record)
        self.spec = loaded.spec
        self.max_seq_len = getattr(loaded.spec, "max_seq_len", None)
        self._device = device_that_exists(device)
        self.model = loaded.model.to(self._device)
        size = int(batch_size) if str(batch_size).isdigit() else 16  # "auto" and the like: the default
        self.scorer = evaluation.Scorer(self.model, evaluation.resolve_max_len(int(max_len), self.max_seq_len, "max_len"), self._device, size)

    def _context(self, text: str) -> list[int]:
        return self.codec.encode(text) if text else [self.codec.eos_id]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [evaluation.encode_pair(ctx, cont, self.codec.encode, self.codec.eos_id) for ctx, cont in (r.args for r in requests)]
        return self.scorer.loglikelihoods(pairs)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in (r.args[:1] for r in requests):
            windows = evaluation.rolling_requests(self.codec.encode(text), self.codec.eos_id, self.scorer.max_len)
            out.append(sum(ll for ll, _ in self.scorer.loglikelihoods(windows)))
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from core.cli.generate import generate

        out = []
        for context, kwargs in (r.args for r in requests):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = generate(
                self.model,
                self._context(context),
                int(kwargs.get("max_gen_toks", 256)),
                max_seq_len=self.max_seq_len,
                eos_id=self.codec.eos_id,
                vocab_limit=self.codec.vocab_size,
                device=self._device,
            )
            text = self.codec.decode(new)
            cut = [text.index(s) for s in until if s and s in text]
            out.append(text[: min(cut)] if cut else text)
        return out


def raised_by_harness_config(err: BaseException) -> bool:
    """Whether ``err`` comes from lm-evaluation-harness's checks of its command line and config (an
    unknown task, a bad flag value), not from the evaluation itself."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""
    return module.startswith(("lm_eval.config", "lm_eval._cli"))


def main(argv: list[str] | None = None) -> int:
    """lm-evaluation-harness's command line (``argv``, default ``sys.argv[1:]``), with ``plait`` registered;
    ``-h``/``--help`` print :data:`HELP` before the harness's help; bad input (plait's errors, lm-evaluation-harness's config checks) is one line, exit 2."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(HELP, flush=True)  # then the harness's own help
    try:
        with torch.no_grad():
            cli_evaluate()
    except PlaitError as e:
        exit_bad_input(e)
    except (ValueError, TypeError, FileNotFoundError) as e:
        if not raised_by_harness_config(e):
            raise
        exit_bad_input(ConfigError(f"lm-evaluation-harness: {' '.join(str(e).split())}"))
    return 0


if __name__ == "__main__":
    sys.argv[0] = "lm_eval"
    raise SystemExit(main())
