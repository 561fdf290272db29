"""Tasks from lm-evaluation-harness's own definitions: lm-evaluation-harness 0.4.13's ``hellaswag.yaml``,
``arc_easy.yaml``, winogrande's ``default.yaml`` and ``wikitext.yaml`` (prompts, ``process_docs``, detokenizer) pointed at small local
files in their real schemas (json lines and parquet), scored by ``core.eval`` and the in-loop
``downstream`` monitor and by lm-evaluation-harness's stock ``hf`` model on ``core.export --format hf``:
the same contexts (two-shot, its sampler's seed), per-choice log-likelihoods within 1e-4 nats, identical
``acc`` and ``acc_norm``, the same rolling perplexities; bad task input is one line and exit 2 before
any model is built (``core.eval``) or any process group (``core.plan``)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from conftest import read_metrics, run_module, torchrun, write_tiny_config
from shared import shakespeare_text

from core.loop import evaluation

lm_eval = pytest.importorskip("lm_eval", reason="the optional extra 'eval' (lm-evaluation-harness)")  # the dev extra installs it
TASKS = Path(lm_eval.__file__).parent / "tasks"


def passage(text: str, rng: random.Random, chars: int) -> str:
    s = rng.randrange(0, len(text) - chars - 1)
    return " ".join(text[s : s + chars].split()) or "nothing"


def hellaswag_rows(n: int, seed: int) -> list[dict]:
    """Rows in Rowan/hellaswag's schema (bracketed WikiHow artefacts included), from Shakespeare."""
    text, rng = shakespeare_text(), random.Random(seed)
    rows = []
    for i in range(n):
        endings = [passage(text, rng, rng.randrange(12, 40)) for _ in range(4)]
        endings[i % 4] = endings[i % 4] + " [title] and more"
        ctx_a, ctx_b = passage(text, rng, 60), passage(text, rng, 15).lower()
        rows.append(
            {"ind": i, "activity_label": ["Baking", "Café", "Running"][i % 3], "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
             "endings": endings, "source_id": f"s{i}", "split": "val", "split_type": "indomain", "label": str(rng.randrange(4))}
        )  # fmt: skip
    return rows


def arc_rows(n: int, seed: int) -> list[dict]:
    """Rows in allenai/ai2_arc's schema: 3 to 5 choices labelled A.. or 1.., answerKey among them."""
    text, rng = shakespeare_text(), random.Random(seed)
    rows = []
    for i in range(n):
        k = 3 + i % 3
        labels = [str(j + 1) for j in range(k)] if i % 4 == 0 else [chr(65 + j) for j in range(k)]
        texts = [passage(text, rng, rng.randrange(4, 30)) for _ in range(k)]
        rows.append({"id": f"q{i}", "question": passage(text, rng, 70) + "?", "choices": {"text": texts, "label": labels}, "answerKey": rng.choice(labels)})
    return rows


def winogrande_rows(n: int, seed: int) -> list[dict]:
    """Rows in allenai/winogrande's schema: a sentence with a blank, two options, answer "1" or "2"."""
    text, rng = shakespeare_text(), random.Random(seed)
    return [
        {
            "sentence": f"{passage(text, rng, 50)} _ {passage(text, rng, 30)}",
            "option1": passage(text, rng, 8),
            "option2": passage(text, rng, 12),
            "answer": rng.choice("12"),
        }
        for _ in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow", reason="lm-evaluation-harness's datasets read parquet with pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def task_yaml(path: Path, include: Path, name: str, builder: str, files: dict[str, Path]) -> Path:
    """A task that is lm-evaluation-harness's own ``include`` pointed at local ``files`` by ``builder``."""
    data = "".join(f"    {split}: {file}\n" for split, file in files.items())
    path.write_text(f"include: {include}\ntask: {name}\ndataset_path: {builder}\ndataset_name: null\ndataset_kwargs:\n  data_files:\n{data}")
    return path


def multi_gold_rows(n: int, seed: int) -> list[dict]:
    """Questions with 2 to 4 choices and one to all but one of them right (lm-evaluation-harness's multiple_target;
    zero-shot: its few-shot contexts cannot render a list of gold indices)."""
    text, rng = shakespeare_text(), random.Random(seed)
    rows = []
    for i in range(n):
        k = 2 + i % 3
        golds = sorted(rng.sample(range(k), rng.randrange(1, k)))
        rows.append({"question": passage(text, rng, 50), "choices": [passage(text, rng, rng.randrange(4, 20)) for _ in range(k)], "golds": golds})
    return rows


def write_tasks(folder: Path) -> dict[str, Path]:
    """hellaswag-like (json lines), arc-like (parquet) and wikitext-like (json lines, pages longer than max_len) task folders,
    a task with several gold answers (13 documents) and a group of it, the arc-like and the winogrande-like
    tasks (20 each) that aggregates acc weighted by size and acc_norm (not winogrande's metric) not."""
    folder.mkdir(parents=True, exist_ok=True)
    hs = {s: write_jsonl(folder / f"hs_{s}.jsonl", hellaswag_rows(n, seed)) for s, n, seed in (("train", 12, 1), ("validation", 20, 2))}
    arc = {s: write_parquet(folder / f"arc_{s}.parquet", arc_rows(n, seed)) for s, n, seed in (("train", 10, 3), ("validation", 4, 4), ("test", 20, 5))}
    wino = {s: write_jsonl(folder / f"wino_{s}.jsonl", winogrande_rows(n, seed)) for s, n, seed in (("train", 8, 7), ("validation", 20, 8))}
    text, rng = shakespeare_text(), random.Random(6)
    pages = [{"page": " = Act = \n " + " @-@ ".join(passage(text, rng, rng.randrange(300, 1500)) for _ in range(2)) + " \n"} for _ in range(5)]
    wiki = {s: write_jsonl(folder / f"wiki_{s}.jsonl", pages) for s in ("train", "validation", "test")}
    multi = write_jsonl(folder / "multi_validation.jsonl", multi_gold_rows(13, 9))
    (folder / "local_multi.yaml").write_text(
        f"task: local_multi\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: {multi}\nvalidation_split: validation\nnum_fewshot: 0\n"
        'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: golds\n'
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
    )
    (folder / "local_group.yaml").write_text(
        "group: local_group\ntask: [local_arc, local_multi, local_wino]\naggregate_metric_list:\n  - {metric: acc, aggregation: mean, weight_by_size: true}\n"
        "  - {metric: acc_norm, aggregation: mean, weight_by_size: false}\n"
    )
    return {
        "local_multi": folder / "local_multi.yaml",
        "local_group": folder / "local_group.yaml",
        "local_hellaswag": task_yaml(folder / "local_hellaswag.yaml", TASKS / "hellaswag" / "hellaswag.yaml", "local_hellaswag", "json", hs),
        "local_arc": task_yaml(folder / "local_arc.yaml", TASKS / "arc" / "arc_easy.yaml", "local_arc", "parquet", arc),
        "local_wino": task_yaml(folder / "local_wino.yaml", TASKS / "winogrande" / "default.yaml", "local_wino", "json", wino),
        "local_wiki": task_yaml(folder / "local_wiki.yaml", TASKS / "wikitext" / "wikitext.yaml", "local_wiki", "json", wiki),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """12 steps of the tiny byte-level model with the downstream monitor on the three tasks (two-shot),
    one named (harness_tasks, found in include_path) and two as .yaml files, and its Hugging Face export."""
    tmp = tmp_path_factory.mktemp("harness")
    yamls = write_tasks(tmp / "tasks")
    body = (
        f'[monitors.downstream]\nevery = 6\ntasks = ["{yamls["local_arc"]}", "{yamls["local_wiki"]}"]\nharness_tasks = ["local_hellaswag"]\n'
        f'include_path = ["{tmp / "tasks"}"]\nnum_fewshot = 2\nlimit = 0\n[optimizer]\nlr = 3e-3\n'
    )
    cfg = write_tiny_config(tmp, body=body, steps=12, global_batch_tokens=2048, micro_batch=4)
    cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["downstream", "console", "jsonl"]'))
    r = run_module("core.train", "--config", str(cfg), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp / "out" / "checkpoints" / "step_000000012"
    r = run_module("core.export", "--checkpoint", str(ckpt), "--format", "hf", "--out", str(tmp / "hf"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"dir": tmp, "tasks": tmp / "tasks", "yamls": yamls, "out": tmp / "out", "ckpt": ckpt, "hf": tmp / "hf"}


def core_eval(trained, tmp_path: Path, *tasks: str) -> tuple[dict[str, float], list[dict]]:
    out, log = tmp_path / "m.json", tmp_path / "samples.jsonl"
    r = run_module(
        "core.eval", "--checkpoint", str(trained["ckpt"]), "--tasks", *tasks, "--include_path", str(trained["tasks"]), "--num_fewshot", "2",
        "--json", str(out), "--log-samples", str(log), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(Path(t).stem in r.stdout for t in tasks), r.stdout  # a row per task asked
    return json.loads(out.read_text())["metrics"], [json.loads(line) for line in log.read_text().splitlines()]


def test_harness_tasks_score_as_lm_evaluation_harness_hf_model_on_the_export(trained, tmp_path):
    """Two-shot (lm-evaluation-harness's sampler, seed 1234): core.eval builds the contexts lm-evaluation-harness
    builds, byte for byte; per choice within 1e-4 nats; acc and acc_norm identical; word_perplexity,
    byte_perplexity and bits_per_byte of the rolling task within 1e-6 relative."""
    pytest.importorskip("transformers", reason="the optional extra 'eval'")
    pytest.importorskip("accelerate", reason="the optional extra 'eval'")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    names = ["local_hellaswag", "local_arc", "local_wino", "local_wiki"]
    lm = HFLM(pretrained=str(trained["hf"]), dtype="float32", device="cpu", batch_size=8)
    out = simple_evaluate(model=lm, tasks=names, num_fewshot=2, task_manager=TaskManager(include_path=str(trained["tasks"])), log_samples=True)
    metrics, samples = core_eval(trained, tmp_path, "local_hellaswag", str(trained["yamls"]["local_arc"]), "local_wino", str(trained["yamls"]["local_wiki"]))
    for name in ("local_hellaswag", "local_arc", "local_wino"):
        theirs = sorted(out["samples"][name], key=lambda d: d["doc_id"])
        ours = [s for s in samples if s["task"] == name]
        assert [s["doc_id"] for s in ours] == [d["doc_id"] for d in theirs] == list(range(20))
        for mine, their in zip(ours, theirs):
            if name == "local_wino":  # multiple_input: a context per choice, one target
                assert [(c, mine["target_delimiter"] + mine["target"]) for c in mine["contexts"]] == [tuple(a) for a in their["arguments"]]
            else:
                assert [(mine["context"], mine["target_delimiter"] + c) for c in mine["choices"]] == [tuple(a) for a in their["arguments"]]
            assert mine["context"].count("\n\n") >= 2  # two examples before the question
            assert max(abs(a - float(r[0][0])) for a, r in zip(mine["loglikelihoods"], their["resps"])) < 1e-4, name
            assert mine["acc"] == their["acc"] and mine["acc_norm"] == their.get("acc_norm", mine["acc_norm"]), (name, mine["doc_id"])
        result = out["results"][name]
        assert result["acc,none"] == pytest.approx(metrics[f"eval/{name}/acc"], abs=1e-9)
        if name != "local_wino":  # winogrande.yaml asks for acc alone
            assert result["acc_norm,none"] == pytest.approx(metrics[f"eval/{name}/acc_norm"], abs=1e-9)
        assert result["acc_stderr,none"] == pytest.approx(metrics[f"eval/{name}/acc_stderr"], abs=1e-9)
    assert any(len(s["choices"]) == 5 for s in samples if s["task"] == "local_arc")  # ARC's 3 to 5 choices, numeric labels too
    theirs = sorted(out["samples"]["local_wiki"], key=lambda d: d["doc_id"])  # --log-samples of a rolling task: a record per document
    ours = [s for s in samples if s["task"] == "local_wiki"]
    assert [s["doc_id"] for s in ours] == [d["doc_id"] for d in theirs] == list(range(5))
    for mine, their in zip(ours, theirs):
        assert mine["loglikelihood"] == pytest.approx(float(their["word_perplexity"][0]), rel=1e-6, abs=1e-4)
        assert [mine["words"], mine["bytes"]] == [their["word_perplexity"][1], their["bits_per_byte"][1]]
    wiki = out["results"]["local_wiki"]
    assert lm.max_length == 1024 and max(len(d["page"].encode()) for d in map(json.loads, (trained["tasks"] / "wiki_test.jsonl").open())) > 1024
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert metrics[f"eval/local_wiki/{metric}"] == pytest.approx(wiki[f"{metric},none"], rel=1e-6), metric
    assert 0 < metrics["eval/local_wiki/bits_per_byte"] < 8


def test_the_in_loop_monitor_scores_harness_tasks_as_core_eval(trained, tmp_path):
    """The downstream monitor (harness_tasks, include_path, num_fewshot) logs at steps 6 and 12 what core.eval
    gives on the step-12 checkpoint, within 1e-6."""
    logged = {r["step"]: r for r in read_metrics(trained["out"])}
    assert "eval/local_hellaswag/acc" in logged[6] and "eval/local_wiki/bits_per_byte" in logged[6]
    metrics, _ = core_eval(trained, tmp_path, "local_hellaswag", "local_arc", "local_wiki")
    assert {"eval/local_arc/acc_norm", "eval/local_hellaswag/acc_norm", "eval/local_wiki/word_perplexity"} <= set(metrics)
    for key, value in metrics.items():
        assert logged[12][key] == pytest.approx(value, abs=1e-6, rel=1e-6), key


def test_lm_evaluation_harness_templates_give_the_prompts_of_hellaswag_arc_and_piqa_from_parquet(tmp_path):
    """Real schemas in parquet, lm-evaluation-harness's own hellaswag, arc_easy and piqa YAMLs: its
    prompts, choices and target_delimiter; a row without an answer, or a file lacking the benchmark's
    columns, is one line naming the task, exit 2."""
    tables = {
        "hellaswag": [
            {
                "activity_label": "Baking",
                "ctx_a": "A man mixes flour.",
                "ctx_b": "he",
                "endings": ["bakes [title] it.", "sings.", "runs.", "flies."],
                "label": "0",
            }
        ],
        "arc_easy": [{"question": "What is 2+2?", "choices": {"text": ["3", "4"], "label": ["A", "B"]}, "answerKey": "B"}],
        "piqa": [{"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat it", "label": 0}],
    }
    includes = {"hellaswag": TASKS / "hellaswag" / "hellaswag.yaml", "arc_easy": TASKS / "arc" / "arc_easy.yaml", "piqa": TASKS / "piqa" / "piqa.yaml"}
    for kind, rows in tables.items():
        data = write_parquet(tmp_path / f"{kind}.parquet", rows)
        yaml = task_yaml(tmp_path / f"my_{kind}.yaml", includes[kind], f"my_{kind}", "parquet", {s: data for s in ("train", "validation", "test")})
        [task] = evaluation.read_tasks([str(yaml)])
        assert isinstance(task, evaluation.Task) and task.name == f"my_{kind}" and len(task.examples) == 1
        ex = task.examples[0]
        assert ex.target_delimiter == " " and not any(c.startswith(" ") for c in ex.continuations)  # lm-evaluation-harness's choices
        if kind == "hellaswag":
            assert ex.context == "Baking: A man mixes flour. He" and ex.continuations[0] == "bakes. it." and ex.gold == 0
        if kind == "arc_easy":
            assert ex.context == "Question: What is 2+2?\nAnswer:" and ex.continuations[ex.gold] == "4"
        if kind == "piqa":
            assert ex.continuations == ("twist the lid", "eat it") and ex.gold == 0
    unlabelled = write_parquet(tmp_path / "unlabelled.parquet", [{**tables["hellaswag"][0], "label": ""}])
    mismatched = tmp_path / "piqa.parquet"  # piqa's columns under arc_easy's template
    for name, include, data, says in (
        ("hs_unlabelled", includes["hellaswag"], unlabelled, "invalid literal for int()"),
        ("arc_on_piqa", includes["arc_easy"], mismatched, "'question' is undefined"),
    ):
        yaml = task_yaml(tmp_path / f"{name}.yaml", include, name, "parquet", {s: data for s in ("train", "validation", "test")})
        r = run_module("core.eval", "--checkpoint", str(tmp_path / "never_loaded"), "--tasks", str(yaml), timeout=300)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("plait: error:")]
        assert r.returncode == 2 and len(errors) == 1 and str(yaml) in errors[0] and says in errors[0], r.stderr[-3000:]
        assert "Traceback" not in r.stderr


def bad_task(folder: Path, case: str) -> tuple[list[str], str]:
    """(--tasks / harness_tasks entries, what the one line says) for each kind of bad task input."""
    data = write_jsonl(folder / "qa.jsonl", [{"question": "2+2?", "answer": "4"}])
    if case == "unknown":
        return ["hellaswagg"], "unknown lm-evaluation-harness task 'hellaswagg' (did you mean 'hellaswag'?)"
    if case == "hub":
        return [
            "hellaswag"
        ], "task 'hellaswag' could not be loaded (ConnectionError: Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)); expected local data"
    if case == "stock_output_type":  # said from its config, before its (hub) data is looked for
        return ["gsm8k"], "task 'gsm8k' has output_type 'generate_until'; plait scores multiple_choice and loglikelihood_rolling"
    (folder / "gen.yaml").write_text(
        f"task: my_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
    )
    return [str(folder / "gen.yaml")], "task 'my_gen' (" + str(
        folder / "gen.yaml"
    ) + ") has output_type 'generate_until'; plait scores multiple_choice and loglikelihood_rolling"


@pytest.mark.parametrize("module", ["core.eval", "core.plan"])
@pytest.mark.parametrize("case", ["unknown", "output_type", "stock_output_type", "hub"])
def test_bad_harness_task_is_one_line_and_exit_2_before_any_model(tmp_path, module, case):
    """An unknown name, an output type plait does not score, a hub dataset with no network (none here: the
    Hub is kept offline, so this never waits): one line naming the task and what was expected, exit 2,
    from core.eval before the checkpoint is read and from core.plan (the downstream monitor) before any process group."""
    tasks, says = bad_task(tmp_path, case)
    if module == "core.eval":
        r = run_module("core.eval", "--checkpoint", str(tmp_path / "never_loaded"), "--tasks", *tasks, timeout=300)
    else:
        key = "tasks" if tasks[0].endswith(".yaml") else "harness_tasks"
        cfg = write_tiny_config(tmp_path, body=f"[monitors.downstream]\nevery = 2\n{key} = {json.dumps(tasks)}\n")
        cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["downstream", "console", "jsonl"]'))
        r = run_module("core.plan", "--config", str(cfg), timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("plait: error:")]
    assert r.returncode == 2 and len(errors) == 1 and says in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "out" / "checkpoints").exists()
    if module == "core.plan":
        assert "monitors.downstream" in errors[0]


def test_without_lm_evaluation_harness_a_harness_task_is_one_line_and_plait_task_files_still_work(tmp_path):
    """lm_eval absent (a stand-in package that raises as a missing one does): a task name is one line naming
    the extra, exit 2; a .jsonl task file never imports it."""
    shim = tmp_path / "shim" / "lm_eval"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'lm_eval'\", name='lm_eval')\n")
    env = {"PYTHONPATH": str(shim.parent)}
    r = run_module("core.eval", "--checkpoint", str(tmp_path / "never_loaded"), "--tasks", "hellaswag", extra_env=env, timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("plait: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    assert "'hellaswag' is an lm-evaluation-harness task and needs lm_eval, in the optional extra 'eval'" in errors[0]
    task = write_jsonl(tmp_path / "toy.jsonl", [{"context": "a", "continuations": [" b"], "gold": 3}])
    r = run_module("core.eval", "--checkpoint", str(tmp_path / "never_loaded"), "--tasks", str(task), extra_env=env, timeout=300)
    assert r.returncode == 2 and f"{task}:1: 'gold' is 3" in r.stderr and "optional extra" not in r.stderr, r.stderr[-3000:]


def test_rolling_metrics_are_lm_evaluation_harness_weighted_perplexity_and_bits_per_byte():
    task = evaluation.RollingTask("w", "w.yaml", ["a b", "c"], words=3, n_bytes=4)
    m = evaluation.rolling_metrics(task, [6.0, 4.0])
    assert m["eval/w/word_perplexity"] == pytest.approx(math.exp(2.0))
    assert m["eval/w/byte_perplexity"] == pytest.approx(math.exp(1.5))
    assert m["eval/w/bits_per_byte"] == pytest.approx(1.5 / math.log(2))


def test_a_group_and_several_gold_answers_score_as_lm_evaluation_harness(trained, tmp_path):
    """A group YAML (task: [local_arc, local_multi, local_wino], aggregate_metric_list acc weighted by size,
    acc_norm not, over the tasks whose metric_list has it: not winogrande's) and a task whose doc_to_target is a list of right answers: per choice within 1e-4 nats, acc and
    acc_norm per document as lm-evaluation-harness's (right when the argmax is any gold), and each task's and
    the group's acc, acc_norm and their pooled standard errors equal lm-evaluation-harness's (hf model on
    the export, two-shot where the task does not fix 0) within 1e-9."""
    pytest.importorskip("transformers", reason="the optional extra 'eval'")
    pytest.importorskip("accelerate", reason="the optional extra 'eval'")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(trained["hf"]), dtype="float32", device="cpu", batch_size=8)
    out = simple_evaluate(model=lm, tasks=["local_group"], num_fewshot=2, task_manager=TaskManager(include_path=str(trained["tasks"])), log_samples=True)
    metrics, samples = core_eval(trained, tmp_path, "local_group")
    ours = [s for s in samples if s["task"] == "local_multi"]
    theirs = sorted(out["samples"]["local_multi"], key=lambda d: d["doc_id"])
    assert len(ours) == len(theirs) == 13 and any(len(s["gold"]) > 1 for s in ours)
    for mine, their in zip(ours, theirs):
        assert max(abs(a - float(r[0][0])) for a, r in zip(mine["loglikelihoods"], their["resps"])) < 1e-4
        assert (mine["acc"], mine["acc_norm"]) == (their["acc"], their["acc_norm"]) and mine["gold"] == their["target"], mine["doc_id"]
    for name in ("local_arc", "local_multi", "local_group"):
        for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
            assert metrics[f"eval/{name}/{metric}"] == pytest.approx(out["results"][name][f"{metric},none"], abs=1e-9), (name, metric)
    acc = [metrics[f"eval/{name}/acc"] for name in ("local_arc", "local_multi", "local_wino")]
    acc_norm = metrics["eval/local_arc/acc_norm"], metrics["eval/local_multi/acc_norm"]
    assert metrics["eval/local_group/acc"] == pytest.approx((20 * acc[0] + 13 * acc[1] + 20 * acc[2]) / 53)  # weight_by_size: true
    assert metrics["eval/local_group/acc_norm"] == pytest.approx((acc_norm[0] + acc_norm[1]) / 2)  # weight_by_size: false


def test_two_ranks_score_harness_tasks_as_one_process(trained, tmp_path):
    """The downstream monitor on 2 gloo ranks (ddp, real processes) with lm-evaluation-harness tasks by name
    (a group, two-shot hellaswag) and by .yaml (a rolling task whose windows are split over the ranks): at
    the final step its metrics equal core.eval's on that checkpoint in one process, within 1e-6."""
    body = (
        f'[monitors.downstream]\nevery = 4\ntasks = ["{trained["yamls"]["local_wiki"]}"]\nharness_tasks = ["local_group", "local_hellaswag"]\n'
        f'include_path = ["{trained["tasks"]}"]\nnum_fewshot = 2\nlimit = 0\n'
    )
    cfg = write_tiny_config(tmp_path, body=body, steps=4, global_batch_tokens=2048, micro_batch=4)
    cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["downstream", "console", "jsonl"]'))
    r = torchrun(2, "--config", str(cfg), "--parallelism.name=ddp", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    logged = {row["step"]: row for row in read_metrics(tmp_path / "out")}
    alone, _ = core_eval(
        {**trained, "ckpt": tmp_path / "out" / "checkpoints" / "step_000000004"},
        tmp_path,
        "local_group",
        "local_hellaswag",
        str(trained["yamls"]["local_wiki"]),
    )
    assert {"eval/local_group/acc", "eval/local_multi/acc", "eval/local_hellaswag/acc_norm", "eval/local_wiki/bits_per_byte"} <= set(alone)
    for key, value in alone.items():
        assert logged[4][key] == pytest.approx(value, abs=1e-6, rel=1e-6), key
