"""Downstream evaluation over real runs: bad task files and a bad ``every`` are exit 2 before any process
group; the ``downstream`` monitor logs every metric at its steps and retention keeps the best by it; a
trained model scores above chance; ``core.eval`` agrees with the loop and with lm-evaluation-harness;
training is bit-identical with evaluation on and off (two ranks, fp8); evaluation runs under fsdp2 and
bf16 with uneven shares. lm-evaluation-harness's own task definitions: test_evaluation_tasks.py."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from conftest import read_metrics, run_module, torchrun, write_tiny_config
from shared import shakespeare_text, write_task

from core.loop import evaluation


def write_long_task(path: Path, n: int, chars: int) -> Path:
    """Contexts of ``chars`` characters of Shakespeare (longer than a training sequence in bytes), the
    8 that follow as gold among 3 passages from elsewhere, after a target_delimiter of one space."""
    text, rng = shakespeare_text(), random.Random(5)
    with path.open("w") as f:
        for _ in range(n):
            s = rng.randrange(0, len(text) - chars - 20)
            choices = [text[(o := rng.randrange(0, len(text) - 10)) : o + 8].strip() or "x" for _ in range(3)]
            g = rng.randrange(4)
            choices.insert(g, text[s + chars : s + chars + 8].strip() or "x")
            f.write(json.dumps({"context": text[s : s + chars].rstrip(), "continuations": choices, "gold": g, "target_delimiter": " "}) + "\n")
    return path


def downstream_body(every: int, tasks: list[Path], held_out: Path | None = None) -> str:
    held = f'\nheld_out = {{shakes = "{held_out}"}}' if held_out else ""
    return f"[monitors.downstream]\nevery = {every}\ntasks = [{', '.join(json.dumps(str(t)) for t in tasks)}]\nlimit = 0{held}\n"


def test_bad_task_file_is_exit_2_in_plan_and_train_before_any_process_group(tmp_path):
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "a", "continuations": [" b"], "gold": 0}\n{"context": "a", "continuations": [" b"], "gold": 3}\n')
    cfg = write_tiny_config(
        tmp_path, body=downstream_body(2, [task]).replace("[monitors.downstream]", '[monitors]\nenabled = ["downstream"]\n[monitors.downstream]')
    )
    cfg.write_text(cfg.read_text().replace('[monitors]\nenabled = ["console", "jsonl"]\n', ""))
    for module in ("core.plan", "core.train"):
        r = run_module(module, "--config", str(cfg), timeout=240)
        assert r.returncode == 2, (module, r.stdout, r.stderr)
        errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
        assert any(f"{task}:2: 'gold' is 3" in ln for ln in errors), (module, r.stderr)
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()  # nothing built


def test_a_task_or_held_out_line_over_the_limit_is_one_line_and_exit_2_in_every_reader(tmp_path):
    """A line just over the 1 MiB limit (the attack: one line of 6 GiB, read whole into a MemoryError):
    ``core.eval`` and the downstream monitor's preflight (``core.plan``) each say ``file:line`` in one
    line, exit 2, no traceback (bounded reads: tests/unit/loop/test_evaluation_unit.py)."""
    over = "x" * (evaluation.MAX_LINE_BYTES + 1)
    good = write_task(tmp_path / "good.jsonl", 4, False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + '{"context": "' + over + '", "continuations": [" b"], "gold": 0}\n')
    held = tmp_path / "held.txt"
    held.write_text("a first line\n" + over + "\n")
    where = {bad: f"{bad}:5: a line of over", held: f"{held}:2: a line of over"}
    runs = [
        (bad, ["core.eval", "--checkpoint", str(tmp_path / "never_loaded"), "--tasks", str(bad)]),
        (bad, ["core.plan", "--config", str(write_tiny_config(tmp_path, "bad.toml", body=downstream_body(2, [bad])))]),
        (held, ["core.plan", "--config", str(write_tiny_config(tmp_path, "held.toml", body=downstream_body(2, [good], held)))]),
    ]
    for path, argv in runs:
        if argv[0] == "core.plan":
            cfg = Path(argv[2])
            cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["downstream", "console", "jsonl"]'))
        r = run_module(*argv, timeout=240)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("plait: error:")]
        assert r.returncode == 2 and len(errors) == 1 and where[path] in errors[0], (argv[0], r.stderr[-2000:])
        assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr


def test_an_every_that_is_not_a_positive_multiple_of_log_every_is_exit_2(tmp_path):
    task = write_task(tmp_path / "task.jsonl", 4, False)
    body = downstream_body(3, [task]).replace("[monitors.downstream]", '[monitors]\nenabled = ["downstream"]\n[monitors.downstream]')
    cfg = write_tiny_config(tmp_path, body=body)
    cfg.write_text(cfg.read_text().replace('[monitors]\nenabled = ["console", "jsonl"]\n', "").replace("log_every = 1", "log_every = 2"))
    r = run_module("core.plan", "--config", str(cfg), timeout=240)
    assert r.returncode == 2 and "monitors.downstream.every = 3: expected a multiple of train.log_every = 2" in r.stderr, r.stderr
    r = run_module("core.plan", "--config", str(cfg), "--monitors.downstream.every=0", timeout=240)
    assert r.returncode == 2 and "every" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- training with the monitor ------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 30-step single-rank run (data.seq_len 128) with the downstream monitor on its default max_len,
    keeping the best checkpoint by eval/hard/acc."""
    tmp = tmp_path_factory.mktemp("trained")
    toy, hard = write_task(tmp / "toy.jsonl", 120, False), write_task(tmp / "hard.jsonl", 120, True, seed=1)
    long = write_long_task(tmp / "long.jsonl", 24, 300)  # 300 bytes: longer than the training sequence
    held = tmp / "held.txt"
    held.write_text(shakespeare_text(6000)[1000:4000])
    body = downstream_body(10, [toy, hard, long], held) + (
        '[optimizer]\nlr = 3e-3\n[checkpoint]\nevery = 10\nkeep_latest = 1\nkeep_best = 1\nbest_metric = "eval/hard/gold_ll"\nbest_mode = "max"\n'
    )
    cfg = write_tiny_config(tmp, body=body, steps=30, global_batch_tokens=2048, micro_batch=4)
    cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["downstream", "console", "jsonl"]'))
    r = run_module("core.train", "--config", str(cfg), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"dir": tmp, "toy": toy, "hard": hard, "long": long, "held": held, "out": tmp / "out"}


def test_the_monitor_logs_every_metric_at_its_steps_and_retention_keeps_the_best_by_it(trained):
    rows = {r["step"]: r for r in read_metrics(trained["out"])}
    for step in (10, 20, 30):
        assert {"eval/toy/acc", "eval/toy/acc_norm", "eval/toy/acc_norm_tokens", "eval/hard/gold_ll", "eval/shakes/bpb"} <= set(rows[step])
        assert 0 < rows[step]["eval/time_s"] < 600  # the pass's wall time
    assert not any(k.startswith("eval/") for k in rows[5])
    root = trained["out"] / "checkpoints"
    best = json.loads((root / "BEST.json").read_text())["best"]
    values = {s: rows[s]["eval/hard/gold_ll"] for s in (10, 20, 30)}
    top = max(values, key=values.__getitem__)
    assert [b["step"] for b in best] == [top] and best[0]["eval/hard/gold_ll"] == pytest.approx(values[top])
    assert (root / best[0]["path"]).is_dir()  # kept through pruning (keep_latest = 1)


def test_a_trained_model_scores_above_chance_and_an_untrained_one_near_it(trained):
    import torch

    from core.cli.eval import evaluate_checkpoint
    from core.cli.generate import load

    ckpt = trained["out"] / "checkpoints" / "step_000000030"
    got = evaluate_checkpoint(ckpt, [str(trained["toy"])], {}, max_len=128)
    assert got["eval/toy/acc"] > 0.6, got  # chance: 0.25
    spec = load(ckpt).spec
    torch.manual_seed(0)
    fresh = spec.build()
    spec.init_weights(fresh)
    task = evaluation.read_task(trained["toy"])
    prepared = evaluation.prepare([task], [], lambda s: list(s.encode("utf-8")), 256, spec.vocab_size)
    untrained = evaluation.evaluate_locally(prepared, evaluation.Scorer(fresh, 128))
    assert abs(untrained["eval/toy/acc"] - 0.25) < 0.12, untrained  # 4 choices, 120 examples: one standard deviation is 0.04


def test_core_eval_prints_a_table_writes_json_and_agrees_with_the_loop(trained):
    """Both on their default max_len (one rule: the model's max_seq_len, 1024 here, not data.seq_len 128):
    the same numbers on items and a held-out text longer than the training sequence."""
    ckpt = trained["out"] / "checkpoints" / "step_000000030"
    out = trained["dir"] / "eval.json"
    r = run_module(
        "core.eval", "--checkpoint", str(ckpt), "--tasks", str(trained["toy"]), str(trained["hard"]), str(trained["long"]),
        "--held-out", f"shakes={trained['held']}", "--json", str(out), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "acc_norm" in r.stdout and "hard" in r.stdout and "long" in r.stdout and "shakes" in r.stdout
    metrics = json.loads(out.read_text())["metrics"]
    logged = {r["step"]: r for r in read_metrics(trained["out"])}[30]
    assert {"eval/long/acc", "eval/long/acc_norm", "eval/long/gold_ll", "eval/shakes/bpb"} <= set(metrics)
    for key, value in metrics.items():
        assert value == pytest.approx(logged[key], abs=1e-6), key
    assert 0 < metrics["eval/shakes/bpb"] < 8
    from core.cli.eval import evaluate_checkpoint

    cut = evaluate_checkpoint(ckpt, [str(trained["long"])], {"shakes": trained["held"]}, max_len=128)  # the training length
    assert abs(cut["eval/long/gold_ll"] - metrics["eval/long/gold_ll"]) > 1e-3  # the comparison can tell the two rules apart
    assert abs(cut["eval/shakes/bpb"] - metrics["eval/shakes/bpb"]) > 1e-4


def test_core_eval_writes_files_only_where_asked(trained, tmp_path):
    """No ``eval.json`` (nor anything else) in the working directory by default; ``--json`` writes only there."""
    ckpt = trained["out"] / "checkpoints" / "step_000000030"
    work = tmp_path / "work"
    work.mkdir()
    r = run_module("core.eval", "--checkpoint", str(ckpt), "--tasks", str(trained["toy"]), "--limit", "8", cwd=work, timeout=300)
    assert r.returncode == 0 and "acc_norm" in r.stdout, r.stderr
    assert list(work.iterdir()) == []
    out = tmp_path / "elsewhere" / "m.json"
    out.parent.mkdir()
    r = run_module("core.eval", "--checkpoint", str(ckpt), "--tasks", str(trained["toy"]), "--limit", "8", "--json", str(out), cwd=work, timeout=300)
    assert r.returncode == 0, r.stderr
    assert list(work.iterdir()) == [] and "eval/toy/acc" in json.loads(out.read_text())["metrics"]


def test_core_eval_logs_samples_and_standard_errors(trained, tmp_path):
    """``--log-samples FILE``: one JSON line per example, its choices' log-likelihoods the scorer's, its acc and
    acc_norm averaging to the metrics; the table and JSON carry ``acc_stderr`` and ``acc_norm_stderr``."""
    from core.cli.generate import load

    ckpt = trained["out"] / "checkpoints" / "step_000000030"
    out, log = tmp_path / "m.json", tmp_path / "samples.jsonl"
    r = run_module(
        "core.eval", "--checkpoint", str(ckpt), "--tasks", str(trained["hard"]), str(trained["toy"]), "--limit", "20",
        "--held-out", f"shakes={trained['held']}", "--json", str(out), "--log-samples", str(log), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0].split()
    assert header[:5] == ["name", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr"], r.stdout
    metrics = json.loads(out.read_text())["metrics"]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["task"], x["index"]) for x in rows] == [("hard", i) for i in range(20)] + [("toy", i) for i in range(20)]
    task = evaluation.read_task(trained["hard"], 20)
    enc = evaluation.encode_task(task, lambda t: list(t.encode("utf-8")), 256, 512)
    lls = [ll for ll, _ in evaluation.Scorer(load(ckpt).model, 1024).loglikelihoods(evaluation.example_requests(enc, range(20)))]
    hard = [x for x in rows if x["task"] == "hard"]
    logged = [v for x in hard for v in x["loglikelihoods"]]
    assert len(logged) == len(lls) and max(abs(a - b) for a, b in zip(logged, lls)) < 1e-5
    for x, ex in zip(hard, task.examples):
        assert (x["context"], x["choices"], x["gold"], x["line"]) == (ex.context, list(ex.continuations), ex.gold, ex.line)
        assert x["acc"] == float(max(range(len(x["choices"])), key=lambda i: (x["loglikelihoods"][i], -i)) == ex.gold)
    for name in ("hard", "toy"):
        mine = [x for x in rows if x["task"] == name]
        for key in ("acc", "acc_norm"):
            values = [x[key] for x in mine]
            p = sum(values) / len(values)
            assert metrics[f"eval/{name}/{key}"] == pytest.approx(p, abs=1e-9)
            assert metrics[f"eval/{name}/{key}_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (len(values) - 1)), abs=1e-9)
    assert "eval/shakes/bpb" in metrics and not any(k.startswith("eval/shakes/") and "stderr" in k for k in metrics)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "samples.jsonl"]


def test_scores_equal_lm_evaluation_harness_on_the_same_checkpoint_and_task(trained, tmp_path):
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")  # the dev extra installs it
    from lm_eval import simple_evaluate
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from core.cli.eval import evaluate_checkpoint
    from core.cli.lm_eval_model import PlaitLM  # registers "plait"

    ckpt = trained["out"] / "checkpoints" / "step_000000030"
    (tmp_path / "hard.yaml").write_text(
        f"task: plait_hard\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {trained['hard']}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{continuations}}"\ndoc_to_target: "{{gold}}"\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
    )
    result = simple_evaluate(
        model="plait",
        model_args=f"checkpoint={ckpt},max_len=128",
        tasks=["plait_hard"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=False,
    )["results"]["plait_hard"]
    ours = evaluate_checkpoint(ckpt, [str(trained["hard"])], {}, max_len=128)
    assert 0.3 < ours["eval/hard/acc"] < 1.0  # neither chance nor trivially 1: the comparison can tell
    assert result["acc,none"] == pytest.approx(ours["eval/hard/acc"], abs=1e-6)
    assert result["acc_norm,none"] == pytest.approx(ours["eval/hard/acc_norm"], abs=1e-6)
    lm = PlaitLM(checkpoint=str(ckpt), max_len=128)
    text = trained["held"].read_text()
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    held = evaluate_checkpoint(ckpt, [], {"shakes": trained["held"]}, max_len=128)
    n_tokens = len(text.encode("utf-8"))
    assert -rolling / n_tokens == pytest.approx(held["eval/shakes/loss"], abs=1e-6)
    [generated] = lm.generate_until([Instance("generate_until", {}, ("To be, or not", {"until": ["\n"], "max_gen_toks": 12}), 0)])
    assert isinstance(generated, str) and "\n" not in generated and len(generated.encode("utf-8")) <= 12


def write_mixed_task(path: Path, n: int) -> Path:
    """Items lm-evaluation-harness treats specially: contexts ending in whitespace, empty contexts,
    non-ASCII text; choices after a target_delimiter of one space."""
    text, rng = shakespeare_text(), random.Random(11)
    extra = ["caf\u00e9 cr\u00e8me", "na\u00efve \u2014 \u00fcber", "\u65e5\u672c\u8a9e", "r\u00e9sum\u00e9"]
    with path.open("w") as f:
        for i in range(n):
            s = rng.randrange(0, len(text) - 100)
            context = [text[s : s + 40].rstrip() + " ", "", text[s : s + 30].rstrip() + "\n\n", "Qu\u00e9 es: " + text[s : s + 20]][i % 4]
            choices = [text[(o := rng.randrange(0, len(text) - 10)) : o + 6].strip() or "x" for _ in range(3)] + [extra[i % 4]]
            rng.shuffle(choices)
            f.write(json.dumps({"context": context, "continuations": choices, "gold": rng.randrange(4), "target_delimiter": " "}) + "\n")
    return path


def harness_task_yaml(folder: Path, name: str, data: Path, delimiter: str) -> None:
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{continuations}}"\ndoc_to_target: "{{gold}}"\n'
        f"target_delimiter: {json.dumps(delimiter)}\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )


def test_the_adapter_scores_whitespace_empty_and_non_ascii_items_as_core_eval_per_choice(trained, tmp_path):
    """lm-evaluation-harness's own request building (target_delimiter, trailing whitespace, empty context)
    and acc_norm through the adapter equal core.eval's: per choice within 1e-5 nats, acc and acc_norm exactly."""
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import core.cli.lm_eval_model  # noqa: F401 - registers "plait"
    from core.cli.eval import evaluate_checkpoint
    from core.cli.generate import load

    ckpt = trained["out"] / "checkpoints" / "step_000000030"
    mixed = write_mixed_task(tmp_path / "mixed.jsonl", 24)
    harness_task_yaml(tmp_path, "plait_mixed", mixed, " ")
    out = simple_evaluate(
        model="plait", model_args=f"checkpoint={ckpt}", tasks=["plait_mixed"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True
    )
    result, samples = out["results"]["plait_mixed"], sorted(out["samples"]["plait_mixed"], key=lambda d: d["doc_id"])
    harness_lls = [float(r[0][0]) for d in samples for r in d["resps"]]
    ours = evaluate_checkpoint(ckpt, [str(mixed)], {})
    task = evaluation.read_task(mixed)
    enc = evaluation.encode_task(task, lambda t: list(t.encode("utf-8")), 256, 512)
    model = load(ckpt).model
    lls = [ll for ll, _ in evaluation.Scorer(model, 1024).loglikelihoods(evaluation.example_requests(enc, range(len(enc))))]
    assert len(harness_lls) == len(lls) == 96
    assert max(abs(a - b) for a, b in zip(harness_lls, lls)) < 1e-5
    assert result["acc,none"] == pytest.approx(ours["eval/mixed/acc"], abs=1e-9)
    assert result["acc_norm,none"] == pytest.approx(ours["eval/mixed/acc_norm"], abs=1e-9)
    moved = [evaluation.encode_pair(e.context, " " + c, lambda t: list(t.encode("utf-8")), 256) for e in task.examples[:1] for c in e.continuations]
    assert all(cont[:2] == [32, 32] for _, cont in moved)  # the trailing space went into the continuation


def test_plait_lm_eval_runs_on_a_cpu_machine_with_the_harness_defaults(trained, tmp_path):
    import torch

    ckpt = trained["out"] / "checkpoints" / "step_000000030"
    harness_task_yaml(tmp_path, "plait_toy", trained["toy"], "")
    r = run_module(
        "core.cli.lm_eval_model", "run", "--model", "plait", "--model_args", f"checkpoint={ckpt}", "--tasks", "plait_toy",
        "--include_path", str(tmp_path), "--limit", "8", timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "plait_toy" in r.stdout and "acc_norm" in r.stdout
    if not torch.cuda.is_available():  # lm-evaluation-harness's default device, cuda:0, replaced in one line
        assert r.stderr.count("plait: warning: device cuda:0: no CUDA device here; evaluating on cpu") == 1, r.stderr[-3000:]


@pytest.mark.parametrize(
    "model_args, task, says",
    [("checkpoint={missing}", "plait_toy", "checkpoint {missing} does not exist"), ("checkpoint={missing}", "no_such_task", "Tasks not found: no_such_task")],
)
def test_bad_input_through_the_adapter_is_one_line_and_exit_2(tmp_path, model_args, task, says):
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    harness_task_yaml(tmp_path, "plait_toy", write_task(tmp_path / "toy.jsonl", 4, False), "")
    missing = tmp_path / "no_checkpoint"
    r = run_module(
        "core.cli.lm_eval_model", "run", "--model", "plait", "--model_args", model_args.format(missing=missing), "--tasks", task,
        "--include_path", str(tmp_path), "--device", "cpu", timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("plait: error: ")]
    assert len(errors) == 1 and says.format(missing=missing) in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory):
    """3 steps of the tiny model on a corpus prepared with a 300-token byte-level BPE."""
    from shared import prepared_project

    proj = tmp_path_factory.mktemp("bpe")
    with pytest.MonkeyPatch.context() as mp:
        prepared_project(proj, mp)
    r = run_module("core.train", "--config", str(proj / "run.toml"), cwd=proj, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return proj / "out" / "checkpoints" / "step_000000003"


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_lm_evaluation_harness_hf_model_on_the_export_equals_plait_per_choice(trained, bpe_checkpoint, tmp_path, kind):
    """lm-evaluation-harness's stock hf model on core.export --format hf, and plait's own paths on the
    checkpoint, score the same task files: per choice within 1e-4 nats, acc and acc_norm identical; and
    the rolling log-likelihood of a text longer than max_len within 1e-5 nats per token."""
    pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")
    pytest.importorskip("transformers", reason="the optional extra 'eval'")
    pytest.importorskip("accelerate", reason="the optional extra 'eval'")
    from lm_eval import simple_evaluate
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from core.cli.eval import evaluate_checkpoint
    from core.cli.generate import load
    from core.cli.text_codec import Codec

    ckpt = trained["out"] / "checkpoints" / "step_000000030" if kind == "bytes" else bpe_checkpoint
    hf = tmp_path / "hf"
    r = run_module("core.export", "--checkpoint", str(ckpt), "--format", "hf", "--out", str(hf), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    tasks = {
        "mixed": (write_mixed_task(tmp_path / "mixed.jsonl", 24), " "),  # trailing whitespace, empty contexts, non-ASCII
        "long": (write_long_task(tmp_path / "long.jsonl", 8, 300), " "),  # longer than the training sequence (128)
        "hard": (write_task(tmp_path / "hard.jsonl", 16, True, seed=3), ""),  # continuations as written
    }
    for name, (data, delimiter) in tasks.items():
        harness_task_yaml(tmp_path, f"plait_{name}", data, delimiter)
    lm = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=8)
    out = simple_evaluate(model=lm, tasks=[f"plait_{n}" for n in tasks], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    loaded = load(ckpt)
    codec = Codec(loaded.tokenizer)
    max_len = evaluation.resolve_max_len(0, loaded.spec.max_seq_len, "max_len")
    assert lm.max_length == max_len == 1024 and lm.prefix_token_id == codec.eos_id
    scorer = evaluation.Scorer(loaded.model, max_len)
    for name, (data, _) in tasks.items():
        samples = sorted(out["samples"][f"plait_{name}"], key=lambda d: d["doc_id"])
        theirs = [float(r[0][0]) for d in samples for r in d["resps"]]
        task = evaluation.read_task(data)
        enc = evaluation.encode_task(task, codec.encode, codec.eos_id, loaded.spec.vocab_size)
        ours = [ll for ll, _ in scorer.loglikelihoods(evaluation.example_requests(enc, range(len(enc))))]
        assert len(theirs) == len(ours) == 4 * len(task.examples)
        assert max(abs(a - b) for a, b in zip(theirs, ours)) < 1e-4, name
        metrics = evaluate_checkpoint(ckpt, [str(data)], {})
        result = out["results"][f"plait_{name}"]
        assert result["acc,none"] == pytest.approx(metrics[f"eval/{name}/acc"], abs=1e-9), name
        assert result["acc_norm,none"] == pytest.approx(metrics[f"eval/{name}/acc_norm"], abs=1e-9), name
    text = shakespeare_text(9000)[2000:8000]  # 6000 bytes: several windows of 1024, the last one partial
    held = tmp_path / "held.txt"
    held.write_text(text)
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    n_tokens = len(codec.encode(text))
    assert n_tokens > max_len and n_tokens % max_len
    loss = evaluate_checkpoint(ckpt, [], {"held": held})["eval/held/loss"]
    assert abs(-rolling / n_tokens - loss) < 1e-5


# -- two ranks ---------------------------------------------------------------


@pytest.mark.slow
def test_two_rank_training_is_bit_identical_with_evaluation_on_and_off_and_scores_match_one_process(tmp_path):
    toy = write_task(tmp_path / "toy.jsonl", 21, False)  # 21: the ranks' shares differ in size
    runs = {}
    for name, on in (("off", False), ("on", True)):
        folder = tmp_path / name
        folder.mkdir()
        body = downstream_body(2, [toy]) if on else ""
        cfg = write_tiny_config(folder, body=body, steps=4, global_batch_tokens=2048, micro_batch=4)
        if on:
            cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["console", "downstream", "jsonl"]'))
        r = torchrun(2, "--config", str(cfg), "--parallelism.name=ddp", timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = read_metrics(folder / "out")
    assert [r["loss"] for r in runs["on"]] == [r["loss"] for r in runs["off"]]  # bit-identical
    assert [r["grad_norm"] for r in runs["on"]] == [r["grad_norm"] for r in runs["off"]]
    from core.cli.eval import evaluate_checkpoint

    alone = evaluate_checkpoint(tmp_path / "on" / "out" / "checkpoints" / "step_000000004", [str(toy)], {}, max_len=128)
    final = runs["on"][-1]
    for key, value in alone.items():
        assert final[key] == pytest.approx(value, abs=1e-6) and math.isfinite(value), key


@pytest.mark.slow
def test_fp8_training_is_bit_identical_with_evaluation_on_and_off(tmp_path):
    """Under torchao float8 linears (emulated on CPU), the evaluation's forwards change no training
    state either: the same losses and gradient norms, bit for bit, and finite scores at its steps."""
    toy = write_task(tmp_path / "toy.jsonl", 9, False)
    runs = {}
    for name, on in (("off", False), ("on", True)):
        folder = tmp_path / name
        folder.mkdir()
        cfg = write_tiny_config(folder, body=downstream_body(2, [toy]) if on else "", steps=4)
        if on:
            cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["console", "downstream", "jsonl"]'))
        r = run_module("core.train", "--config", str(cfg), "--precision.name=fp8", "--precision.allow_cpu=true", timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "linears in float8" in r.stdout + r.stderr, r.stdout[-2000:]  # the float8 linears are in place
        runs[name] = read_metrics(folder / "out")
    assert [r["loss"] for r in runs["on"]] == [r["loss"] for r in runs["off"]]  # bit-identical
    assert [r["grad_norm"] for r in runs["on"]] == [r["grad_norm"] for r in runs["off"]]
    scored = {row["step"]: row for row in runs["on"] if "eval/toy/acc" in row}
    assert sorted(scored) == [2, 4] and all(math.isfinite(row["eval/toy/gold_ll"]) for row in scored.values())


@pytest.mark.slow
def test_evaluation_runs_under_fsdp2_and_bf16_with_uneven_shares(tmp_path):
    toy = write_task(tmp_path / "toy.jsonl", 21, False)  # 11 and 10 examples: the shorter share pads its forwards
    cfg = write_tiny_config(tmp_path, body=downstream_body(2, [toy]), steps=4, global_batch_tokens=2048, micro_batch=4)
    cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["console", "jsonl", "downstream"]'))
    r = torchrun(2, "--config", str(cfg), "--parallelism.name=fsdp2", "--precision.name=bf16", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["step"]: row for row in read_metrics(tmp_path / "out")}
    for step in (2, 4):
        assert 0 <= rows[step]["eval/toy/acc"] <= 1 and math.isfinite(rows[step]["eval/toy/gold_ll"]), rows[step]
