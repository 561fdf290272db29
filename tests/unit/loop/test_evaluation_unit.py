"""Downstream evaluation in this process: a bad task line, or a text the tokenizer cannot encode, is one
error naming the file and line; missing, empty and twice-named task files are refused; the scorer
batches contexts sharing one token and pads forwards; rolling windows predict every token once."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from shared import write_task

from core.contract.errors import ConfigError, DataError
from core.loop import evaluation

# -- task files -------------------------------------------------------------


@pytest.mark.parametrize(
    "line, says",
    [
        ("not json", ":2: not a JSON line"),
        ('{"context": "a", "continuations": ["b", "c"], "gold": 2}', ":2: 'gold' is 2; expected an index into the 2 continuations"),
        ('{"context": "a", "continuations": [], "gold": 0}', ":2: 'continuations' must be a non-empty list"),
        ('{"context": "a", "gold": 0}', ":2: missing 'continuations'"),
        ("[1, 2]", ":2: expected a JSON object"),
    ],
)
def test_a_bad_task_line_is_one_error_naming_the_file_and_line(tmp_path, line, says):
    f = tmp_path / "t.jsonl"
    f.write_text('{"context": "a", "continuations": [" b"], "gold": 0}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        evaluation.read_task(f)
    assert str(e.value).startswith(str(f)) and says in str(e.value) and "\n" not in str(e.value)


def test_a_line_over_the_limit_is_refused_naming_its_line_without_being_read_whole(tmp_path):
    """A task or held-out text file with one line of 16 MiB (the attack: 6 GiB, a MemoryError or the OOM killer):
    one DataError naming ``file:line``, and the reader never held much more than the 1 MiB limit (tracemalloc:
    the line is read in bounded pieces, never whole). A line of exactly the limit is read."""
    import tracemalloc

    limit = evaluation.MAX_LINE_BYTES
    good = '{"context": "a", "continuations": [" b"], "gold": 0}\n'
    task, held = tmp_path / "t.jsonl", tmp_path / "held.txt"
    task.write_text(good + '{"context": "' + "x" * (16 * limit) + '", "continuations": [" b"], "gold": 0}\n' + good)
    held.write_text("some text\n" + "y" * (16 * limit) + "\n")
    for path, read in (
        (task, lambda: evaluation.read_task(task)),
        (held, lambda: evaluation.read_held_out("h", held, lambda t: list(t.encode()), len, 256, 0)),
    ):
        tracemalloc.start()
        try:
            with pytest.raises(DataError) as e:
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert str(e.value).startswith(f"{path}:2: a line of over {limit} bytes"), e.value
        assert peak < 4 * limit, f"{path.name}: {peak} bytes held while reading"
    task.write_text(good + '{"context": "' + "x" * (limit - len(good) - 10) + '", "continuations": [" b"], "gold": 0}\n')
    assert len(task.read_bytes().splitlines(keepends=True)[1]) <= limit
    assert len(evaluation.read_task(task).examples) == 2


def test_missing_empty_and_twice_named_task_files_are_refused(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        evaluation.read_task(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no examples"):
        evaluation.read_task(tmp_path / "empty.jsonl")
    (tmp_path / "a").mkdir()
    one = write_task(tmp_path / "t.jsonl", 2, False)
    two = write_task(tmp_path / "a" / "t.jsonl", 2, False)
    with pytest.raises(ConfigError, match="task 't' named twice"):
        evaluation.read_tasks([one, two])


def test_a_text_the_tokenizer_cannot_encode_is_one_error_naming_the_file_and_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"context": "a", "continuations": [" b"], "gold": 0}\n{"context": "\u00e9t\u00e9", "continuations": [" c", " "], "gold": 0}\n')
    task = evaluation.read_task(f)

    def ascii_only(text: str) -> list[int]:
        return list(text.encode("ascii"))

    for encode, vocab, says in (
        (ascii_only, 256, ":2: the tokenizer cannot encode this example (UnicodeEncodeError"),
        (lambda text: list(text.strip().encode("utf-8")), 256, ":2: the context or a continuation encodes to no tokens"),
        (lambda text: [200] * max(1, len(text)), 100, ":1: token id 200 is at or above the model's vocabulary size 100"),
    ):
        with pytest.raises(DataError) as e:
            evaluation.encode_task(task, encode, 0, vocab)
        assert str(e.value).startswith(str(f)) and says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert evaluation.encode_task(evaluation.Task("t", f, task.examples[:1]), ascii_only, 0, 256) == [evaluation.Encoded([97], [[32, 98]])]


# -- scoring ---------------------------------------------------------------


class Counting:
    """A stand-in model: logits that favour token ``i + 1`` after token ``i``; counts forwards."""

    def __init__(self, vocab: int = 8) -> None:
        import torch

        self.vocab, self.calls, self.training = vocab, 0, False
        self.torch = torch

    def __call__(self, ids):
        self.calls += 1
        logits = self.torch.zeros(*ids.shape, self.vocab)
        logits.scatter_(-1, ((ids + 1) % self.vocab)[..., None], 4.0)
        return logits

    def eval(self):
        return self

    def train(self, mode=True):
        return self


def test_scorer_batches_shares_one_token_contexts_and_pads_forwards():
    import torch

    model = Counting()
    scorer = evaluation.Scorer(model, max_len=16, batch_size=2)  # type: ignore[arg-type]
    reqs = [([1, 2], [3]), ([1, 2], [5]), ([1, 2], [3, 4]), ([0], [1, 2, 3])]
    out = scorer.loglikelihoods(reqs, forwards=5)
    p_hit = float(torch.log_softmax(torch.tensor([4.0] + [0.0] * 7), 0)[0])
    p_miss = float(torch.log_softmax(torch.tensor([4.0] + [0.0] * 7), 0)[1])
    assert out[0] == pytest.approx((p_hit, True)) and out[1] == pytest.approx((p_miss, False))
    assert out[2][0] == pytest.approx(2 * p_hit) and out[3][0] == pytest.approx(3 * p_hit)
    assert scorer.forwards(reqs) == 2  # 3 rows (the one-token pair shares its context), 2 per batch
    assert model.calls == 5  # padded to the forwards asked for


def test_the_pass_cost_core_plan_counts_is_the_forwards_the_scorer_runs():
    """``Evaluation.pass_cost`` (what ``core.plan`` prices) lists the (rows, width) of every forward one
    process runs for the pass: tasks with one-token and longer choices, a context cut at ``max_len``,
    a rolling task's two documents and a held-out text in rolling windows."""
    shapes: list[tuple[int, int]] = []

    class Recording(Counting):
        def __call__(self, ids):
            shapes.append(tuple(ids.shape))
            return super().__call__(ids)

    one = evaluation.Example("abc", ("d", "e", "f"), 0, 1)  # one-token choices: one row
    long = evaluation.Example("a" * 30, ("bc", "d"), 1, 2)  # cut at max_len
    task = evaluation.Task("t", evaluation.Path("t.jsonl"), [one, long, one])
    held = evaluation.HeldOut("h", evaluation.Path("h.txt"), [i % 7 for i in range(23)], 23)
    encode = lambda text: [ord(ch) % 7 for ch in text]  # noqa: E731 - ids below the stand-in's vocabulary
    rolling = evaluation.RollingTask("r", "r.yaml", ["abcdefghijk", "abc"], 2, 14)  # 11 ids: 2 windows; 3 ids: 1
    ev = evaluation.prepare([task, rolling], [held], encode, 7, 8)
    cost = ev.pass_cost(max_len=8, batch_size=2)
    evaluation.evaluate_locally(ev, evaluation.Scorer(Recording(), max_len=8, batch_size=2))  # type: ignore[arg-type]
    assert list(cost.forwards) == shapes
    assert cost.tokens == sum(r * w for r, w in shapes) and max(w for _, w in shapes) == 8
    assert cost.items == 3 + 3 + 3 and cost.requests == 3 + 2 + 3 + 3 + 3  # examples and windows; choices and windows


def test_rolling_windows_predict_every_token_once():
    reqs = evaluation.rolling_requests(list(range(10)), prefix=99, max_len=4)
    assert [c for _, c in reqs] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [ctx for ctx, _ in reqs] == [[99], [3], [5, 6, 7]]  # the last window: a full input of 4 tokens


# -- lm-evaluation-harness's scoring rule -------------------------------------
# lm-evaluation-harness 0.4.13's own code is the reference: its TemplateLM encodes the requests, its
# utils make the rolling windows; plait's functions must give the same token ids.

PAIRS = [
    ("Question: what is it?\nAnswer:", " the question"),  # the usual: the space starts the continuation
    ("to be or not to ", "be"),  # trailing whitespace in the context: moved into the continuation
    ("whether tis nob", "ler in the mind"),  # a split inside a word: BPE merges across it
    ("that is the\n\t ", " question"),  # several trailing whitespace characters
    ("", " to be"),  # an empty context: the prefix (EOS) token
    ("", "<|endoftext|>to be"),  # an empty context and a continuation that starts with EOS
    ("caf\u00e9 ", "cr\u00e8me br\u00fbl\u00e9e \u2014 \u65e5\u672c"),  # non-ASCII
]


def harness_encodings(encode, eos_id: int, pairs):
    """(context ids, continuation ids) of each pair as lm-evaluation-harness's LM.loglikelihood makes them."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM

    class Recording(TemplateLM):
        eot_token_id = eos_id

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return list(encode(string))

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            self.seen = [(list(c), list(k)) for _, c, k in requests]
            return [(0.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError

    lm = Recording()
    lm.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs], disable_tqdm=True)
    return lm.seen


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_encode_pair_gives_lm_evaluation_harness_token_ids(tmp_path, kind):
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    from shared import bpe

    from core.data.text_tokenizer import Tokenizer

    tok = Tokenizer("bytes" if kind == "bytes" else f"hf:{bpe(tmp_path / 'tok')}", None)
    encode = tok.encode
    pairs = PAIRS if kind == "bpe" else [p for p in PAIRS if "<|endoftext|>" not in p[1]]
    want = harness_encodings(encode, tok.eos_id, pairs)
    got = [evaluation.encode_pair(ctx, cont, encode, tok.eos_id) for ctx, cont in pairs]
    assert got == want
    if kind == "bpe":  # the cases tell separate from whole-string encoding apart
        separate = [(encode(c) if c else [tok.eos_id], encode(k)) for c, k in pairs]
        assert sum(s != w for s, w in zip(separate, want)) >= 3


def test_task_lines_with_a_target_delimiter_are_scored_after_it_and_acc_norm_divides_by_the_choice(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"context": "Q: ", "continuations": ["ab", "abcdef"], "gold": 1, "target_delimiter": " "}\n')
    task = evaluation.read_task(f)
    enc = evaluation.encode_task(task, lambda s: list(s.encode("utf-8")), 256, 256)
    assert enc == [evaluation.Encoded(list(b"Q:"), [list(b"  ab"), list(b"  abcdef")])]  # the context's space moved, then the delimiter
    # log-likelihoods -2.9 and -7.5: per character of the choice (2, 6) the second wins (lm-evaluation-harness:
    # len(choice)); per character of what was scored (4, 8) the first would
    sums = evaluation.task_sums(task, enc, [0], [-2.9, -7.5])
    metrics = evaluation.task_metrics("t", sums)
    assert metrics["eval/t/acc"] == 0.0 and metrics["eval/t/acc_norm"] == 1.0
    f.write_text('{"context": "a", "continuations": ["b"], "gold": 0, "target_delimiter": 1}\n')
    with pytest.raises(DataError, match=":1: 'target_delimiter' is int; expected a string"):
        evaluation.read_task(f)


def test_standard_errors_are_lm_evaluation_harness_mean_stderr_of_the_per_example_scores(tmp_path):
    """``acc_stderr`` and ``acc_norm_stderr`` equal lm-evaluation-harness's own ``mean_stderr`` on the per-example
    values that ``task_samples`` (``core.eval --log-samples``) records; summed over two ranks' shares alike."""
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    import random

    from lm_eval.api.metrics import mean_stderr

    f = tmp_path / "t.jsonl"
    rng = random.Random(3)
    lines = []
    for _ in range(23):
        choices = ["a" * rng.randrange(1, 6) for _ in range(3)]
        lines.append(json.dumps({"context": "Q:", "continuations": choices, "gold": rng.randrange(3), "target_delimiter": " "}))
    f.write_text("\n".join(lines) + "\n")
    task = evaluation.read_task(f)
    enc = evaluation.encode_task(task, lambda t: list(t.encode("utf-8")), 256, 256)
    lls = [-rng.uniform(0.5, 12.0) for _ in evaluation.example_requests(enc, range(len(enc)))]
    samples = list(evaluation.task_samples(task, enc, range(len(enc)), lls))
    assert [s["index"] for s in samples] == list(range(23)) and samples[4]["choices"] == list(task.examples[4].continuations)
    assert [x for s in samples for x in s["loglikelihoods"]] == lls
    metrics = evaluation.task_metrics("t", evaluation.task_sums(task, enc, range(len(enc)), lls))
    for key in ("acc", "acc_norm"):
        values = [s[key] for s in samples]
        assert 0 < sum(values) < len(values)  # neither all right nor all wrong: the error is not zero
        assert metrics[f"eval/t/{key}"] == pytest.approx(sum(values) / len(values), abs=1e-12)
        assert metrics[f"eval/t/{key}_stderr"] == pytest.approx(mean_stderr(values), rel=1e-12)
    per = [s["loglikelihoods"] for s in samples]  # two ranks' shares, each in example_requests order
    even, odd = ([ll for e in range(r, 23, 2) for ll in per[e]] for r in (0, 1))
    summed = evaluation.task_sums(task, enc, range(0, 23, 2), even) + evaluation.task_sums(task, enc, range(1, 23, 2), odd)
    assert evaluation.task_metrics("t", summed) == pytest.approx(metrics, abs=1e-12)
    one = evaluation.task_metrics("t", evaluation.task_sums(task, enc, [0], lls[:3]))
    assert "eval/t/acc" in one and "eval/t/acc_stderr" not in one  # one example: no standard error (n - 1 = 0)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 9, 10, 13])
def test_rolling_windows_are_lm_evaluation_harness_windows(n):
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ids = list(range(100, 100 + n))
    want = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, prefix_token=7, max_seq_len=4, context_len=1)]
    assert [(list(c), list(k)) for c, k in evaluation.rolling_requests(ids, 7, 4)] == want
    assert [t for _, k in want for t in k] == ids  # every token predicted once


def test_one_max_len_rule_for_the_loop_and_offline():
    assert evaluation.resolve_max_len(0, 1024, "k") == 1024  # the model's max_seq_len, not the training length
    assert evaluation.resolve_max_len(256, 1024, "k") == 256
    assert evaluation.resolve_max_len(0, None, "k") == evaluation.DEFAULT_MAX_LEN == 2048
    with pytest.raises(ConfigError, match="monitors.downstream.max_len 2048 exceeds the model's max_seq_len 1024"):
        evaluation.resolve_max_len(2048, 1024, "monitors.downstream.max_len")


# -- the lm-evaluation-harness adapter ------------------------------------------


def test_the_adapter_replaces_a_cuda_device_that_does_not_exist_in_one_line(capsys):
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    import torch

    from core.cli.lm_eval_model import device_that_exists

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for asked in ("cuda", "cuda:0", f"cuda:{count + 3}"):  # lm-evaluation-harness passes cuda:0 by default
        got = device_that_exists(asked)
        err = capsys.readouterr().err
        if count == 0:
            assert got == torch.device("cpu") and err == f"plait: warning: device {asked}: no CUDA device here; evaluating on cpu\n"
        elif asked.endswith(str(count + 3)):
            assert got == torch.device("cuda", 0) and err.count("\n") == 1 and f"only {count} CUDA device(s) here" in err
        else:
            assert got.type == "cuda" and err == ""
    assert device_that_exists("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="--device 'gpu0': not a torch device"):
        device_that_exists("gpu0")


def test_a_multiple_input_example_scores_its_target_after_each_context_and_acc_norm_divides_by_the_choice():
    """lm-evaluation-harness's multiple_input (winogrande): choice i is target_delimiter + target after
    contexts[i]; acc_norm divides by the choices' characters, as its process_results does."""
    ex = evaluation.Example("He took the", ("He took the cat", "He took the elephant"), 1, 1, " ", ("He took the cat", "He took the elephant"), "home")
    task = evaluation.Task("w", Path("w.yaml"), [ex], harness=True)
    [enc] = evaluation.encode_task(task, lambda s: list(s.encode("utf-8")), 256, 256)
    assert enc.requests() == [(list(b"He took the cat"), list(b" home")), (list(b"He took the elephant"), list(b" home"))]
    assert evaluation.example_requests([enc], [0]) == enc.requests()
    metrics = evaluation.task_metrics("w", evaluation.task_sums(task, [enc], [0], [-3.0, -3.5]))
    assert metrics["eval/w/acc"] == 0.0 and metrics["eval/w/acc_norm"] == 1.0  # -3/15 < -3.5/20
    assert task.where(ex) == "lm-evaluation-harness task 'w', document 0"


def test_the_downstream_monitor_loads_lm_evaluation_harness_tasks_once_per_process(tmp_path, monkeypatch):
    """Preflight then train start in one process (core.train's order): lm-evaluation-harness's TaskManager
    (a counting wrapper in this process) is built once, and train start scores what preflight read."""
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    import lm_eval.tasks

    from plugins.monitors.downstream import Downstream, DownstreamOptions

    data = write_task(tmp_path / "once.jsonl", 5, False)
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "once_task.yaml").write_text(
        f"task: once_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: {data}\nvalidation_split: validation\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{continuations}}"\ndoc_to_target: "{{gold}}"\n'
    )
    built: list[dict] = []

    class Counting(lm_eval.tasks.TaskManager):  # type: ignore[misc]
        def __init__(self, *args, **kwargs) -> None:
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Counting)
    monitor = Downstream(DownstreamOptions(harness_tasks=["once_task"], include_path=[str(folder)], limit=0))
    spec = SimpleNamespace(vocab_size=512, max_seq_len=64)
    monitor.plait_preflight(SimpleNamespace(resolved={"train": {"log_every": 1}}, tokenizer={"spec": "bytes"}, spec=spec))
    assert len(built) == 1 and monitor.evaluation is not None
    first = monitor.evaluation.tasks[0]
    monitor.plait_train_start(SimpleNamespace(tokenizer={"spec": "bytes"}, spec=spec))
    assert len(built) == 1  # the second load reads nothing again
    assert monitor.evaluation.tasks[0].name == "once_task" and monitor.evaluation.tasks[0].examples == first.examples and len(first.examples) == 5
