"""Downstream evaluation in this process: a bad task line, or a text the tokenizer cannot encode, is one
error naming the file and line; missing, empty and twice-named task files are refused; the scorer
batches contexts sharing one token and pads forwards; rolling windows predict every token once."""

from __future__ import annotations

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
    assert evaluation.encode_task(evaluation.Task("t", f, task.examples[:1]), ascii_only, 0, 256) == [([97], [[32, 98]])]


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


def test_rolling_windows_predict_every_token_once():
    reqs = evaluation.rolling_requests(list(range(10)), prefix=99, max_len=4)
    assert [c for _, c in reqs] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [ctx for ctx, _ in reqs] == [[99], [3], [7]]
