"""Downstream evaluation: task files, the ``downstream`` monitor, ``core.eval``, lm-evaluation-harness, the converter."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from core.contract.errors import ConfigError, DataError
from core.loop import evaluation

SHAKESPEARE = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def shakespeare_text(chars: int = 200_000) -> str:
    val = np.fromfile(SHAKESPEARE / "val.bin", dtype=np.uint16)[:chars]
    return bytes(int(t) for t in val if t < 256).decode("utf-8", "replace")


def shuffles(gold: str, rng: random.Random) -> list[str]:
    """Three distinct orderings of ``gold``'s characters other than ``gold`` (same characters: only order tells), or []."""
    found: set[str] = set()
    for _ in range(50):
        chars = list(gold)
        rng.shuffle(chars)
        if "".join(chars) != gold:
            found.add("".join(chars))
        if len(found) == 3:
            return sorted(found)
    return []


def write_task(path: Path, n: int, real_distractors: bool, seed: int = 0) -> Path:
    """Contexts of Shakespeare's text; the gold continuation is the 8 characters that follow. Distractors
    are the gold's characters shuffled (learnable: a model of English orders them; an untrained model
    has nothing to tell them apart by) or text from elsewhere (harder)."""
    text, rng = shakespeare_text(), random.Random(seed)
    written = 0
    with path.open("w") as f:
        while written < n:
            s = rng.randrange(0, len(text) - 100)
            gold = text[s + 48 : s + 56]
            others = [text[(o := rng.randrange(0, len(text) - 10)) : o + 8] for _ in range(3)] if real_distractors else shuffles(gold, rng)
            if not others:
                continue
            g = rng.randrange(4)
            others.insert(g, gold)
            f.write(json.dumps({"context": text[s : s + 48], "continuations": others, "gold": g}) + "\n")
            written += 1
    return path


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
