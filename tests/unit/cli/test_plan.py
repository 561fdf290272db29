"""``python -m core.plan``: the run's ETA and cost, sequence-length stages, ``--measure``, what the in-loop evaluation costs, bad flags."""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from shared import plan_json, plan_text

from core.cli.plan import main

GUARD = '["console", "jsonl", "budget_guard"]'


def test_eta_and_cost_from_the_flags(tiny_config, capsys):
    cfg = str(tiny_config(steps=6))  # 1024 tokens/step
    p = plan_json(capsys, "--config", cfg, "--nproc=2", "--tokens-per-s=512", "--usd-per-device-hr=3.6")
    assert p["total_tokens"] == 6 * 1024 and p["world_size"] == 2
    assert p["tokens_per_s"] == 512 and p["tokens_per_s_source"] == "--tokens-per-s"
    assert p["eta_s"] == 6 * 1024 / 512 == 12.0 and p["eta_hours"] == 12.0 / 3600
    assert p["devices"] == 2 and p["usd_per_device_hr"] == 3.6
    assert p["cost_usd"] == pytest.approx(3.6 * 2 * 12.0 / 3600)  # $0.024
    assert p["params_total"] > 0 and "memory_per_rank" in p  # the existing keys stay
    text = plan_text(capsys, "--config", cfg, "--nproc=2", "--tokens-per-s=512", "--usd-per-device-hr=3.6")
    assert "ETA: 12 s for 6.14K tokens at 512 tokens/s" in text
    assert "cost: $0.02 = $3.6/device-hr x 2 devices x 0.00 h (--usd-per-device-hr)" in text


def test_eta_and_cost_from_the_budget_guard_options(tiny_config, capsys):
    body = "[monitors.budget_guard]\nexpected_tokens_per_s = 0.1024\nrate_usd_per_hr = 2.0\ngpus = 4\n"
    cfg = str(tiny_config(steps=6, body=body))
    p = plan_json(capsys, "--config", cfg, f"--monitors.enabled={GUARD}")
    assert p["tokens_per_s_source"] == "[monitors.budget_guard] expected_tokens_per_s"
    assert p["eta_s"] == pytest.approx(6 * 1024 / 0.1024) and p["eta_hours"] == pytest.approx(60_000 / 3600)
    assert p["devices"] == 4  # the guard's billed GPUs, not the world size
    assert p["cost_usd"] == pytest.approx(2.0 * 4 * 60_000 / 3600)
    text = plan_text(capsys, "--config", cfg, f"--monitors.enabled={GUARD}")
    assert "ETA: 16.7 h for 6.14K tokens at 0.1024 tokens/s" in text
    assert "cost: $133.33 = $2/device-hr x 4 devices x 16.67 h ([monitors.budget_guard] rate_usd_per_hr)" in text
    # flags win over the guard's options
    p = plan_json(capsys, "--config", cfg, f"--monitors.enabled={GUARD}", "--tokens-per-s=1024", "--usd-per-device-hr=36")
    assert p["eta_s"] == 6.0 and p["cost_usd"] == pytest.approx(36 * 4 * 6 / 3600)


def test_without_a_throughput_the_eta_is_asked_for_not_guessed(tiny_config, capsys):
    cfg = str(tiny_config())
    text = plan_text(capsys, "--config", cfg, "--usd-per-device-hr=2")
    assert "ETA: give --tokens-per-s or --measure" in text
    assert "needs the ETA" in text and "$" not in text.split("cost:")[1].split("needs")[0].replace("$2/", "")
    p = plan_json(capsys, "--config", cfg)
    assert p["tokens_per_s"] is None and p["eta_s"] is None and p["cost_usd"] is None and p["measured"] is None
    assert "cost: give --usd-per-device-hr" in plan_text(capsys, "--config", cfg, "--tokens-per-s=10")


def test_seq_len_stages_with_their_micro_batch_and_scaled_eta(tiny_config, capsys):
    cfg = str(tiny_config(steps=5, micro_batch=4))  # 1024 tokens/step
    stages = ["--data.seq_len=64", '--monitors.enabled=["seq_len_stages"]', "--monitors.seq_len_stages.stages=[[0.5, 128], [0.8, 256]]"]
    p = plan_json(capsys, "--config", cfg, *stages, "--tokens-per-s=100")
    assert p["grad_accum"] == 4  # 1024 / (4 x 64)
    st = p["seq_len_stages"]
    # step s (0-based) is in the last stage whose start x 5 <= s: steps 0-2, 3, 4; 256 tokens per micro-batch
    assert [(s["seq_len"], s["micro_batch"], s["first_step"], s["last_step"], s["steps"]) for s in st] == [
        (64, 4, 1, 3, 3),
        (128, 2, 4, 4, 1),
        (256, 1, 5, 5, 1),
    ]
    assert sum(s["tokens"] for s in st) == p["total_tokens"] == 5 * 1024
    f = [s["flops_per_token"] for s in st]
    assert f[0] < f[1] < f[2]
    assert p["eta_s"] == pytest.approx((3 * 1024 + 1024 * f[1] / f[0] + 1024 * f[2] / f[0]) / 100)
    text = plan_text(capsys, "--config", cfg, *stages)
    assert "stages      from step 1: seq 64 x micro 4, steps 1-3 (3 steps, 3.07K tokens)" in text
    assert "from step 4: seq 128 x micro 2, steps 4-4" in text and "from step 5: seq 256 x micro 1, steps 5-5" in text
    one = plan_json(capsys, "--config", cfg)["seq_len_stages"]
    assert [(s["seq_len"], s["micro_batch"], s["steps"]) for s in one] == [(128, 4, 5)]


def test_measure_times_real_steps_on_one_process_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "--config",
        str(REPO / "train_configs" / "debug_cpu.toml"),
        f"--train.output_dir={out}",
        "--train.global_batch_tokens=4096",
        "--train.micro_batch=4",
        "--measure",
        "--measure-warmup=1",
        "--measure-steps=1",
        "--usd-per-device-hr=1.5",
    ]
    p = plan_json(capsys, *args, "--nproc=2")  # stdout is clean JSON: the trainer's prints go to stderr
    m = p["measured"]
    assert m["processes"] == 1 and m["timed_steps"] == 1 and m["warmup_steps"] == 1 and m["device"].startswith("cpu")
    assert p["grad_accum"] == 1 and m["micro_batch"] == 4
    assert m["tokens_per_step"] == 4096 and m["grad_accum"] == 2  # the whole global batch on one process
    assert m["seconds"] > 0 and m["tokens_per_s_per_device"] == pytest.approx(4096 / m["seconds"])
    assert p["tokens_per_s"] == pytest.approx(2 * m["tokens_per_s_per_device"])  # scaled by --nproc, said so
    assert "perfect scaling" in p["tokens_per_s_source"]
    assert p["eta_s"] == pytest.approx(p["total_tokens"] / p["tokens_per_s"])
    assert p["cost_usd"] == pytest.approx(1.5 * 2 * p["eta_s"] / 3600)
    assert not out.exists()  # no run folder, no checkpoints, no metrics


def test_measure_text_says_what_was_measured(tiny_config, tmp_path, capsys):
    # monitors with options of their own (a budget guard that would stop the run, a jsonl file) are not run
    body = '[monitors.jsonl]\nfilename = "m.jsonl"\n[monitors.budget_guard]\ncap_usd = 0.000001\nrate_usd_per_hr = 1000.0\n'
    cfg = str(tiny_config(steps=4, body=body))
    text = plan_text(
        capsys,
        "--config",
        cfg,
        "--measure",
        "--measure-warmup=0",
        "--measure-steps=1",
        '--monitors.enabled=["console", "jsonl", "budget_guard"]',
        "--data.name=synthetic",
    )
    assert "tokens/s on 1 process on this machine (cpu:" in text and "1 steps of 1,024 tokens" in text
    assert "perfect scaling" not in text and "ETA: " in text and "ETA: give" not in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--tokens-per-s=-5", "argument --tokens-per-s: expected a finite number > 0, got '-5'"),
        ("--tokens-per-s=nan", "argument --tokens-per-s: expected a finite number > 0, got 'nan'"),
        ("--tokens-per-s=0", "argument --tokens-per-s: expected a finite number > 0, got '0'"),
        ("--usd-per-device-hr=-1", "argument --usd-per-device-hr: expected a finite number >= 0, got '-1'"),
        ("--usd-per-device-hr=inf", "argument --usd-per-device-hr: expected a finite number >= 0, got 'inf'"),
        ("--usd-per-device-hr=cheap", "expected a finite number >= 0, got 'cheap'"),
        ("--measure-steps=0", "argument --measure-steps: expected an integer >= 1, got '0'"),
        ("--measure-warmup=-1", "argument --measure-warmup: expected an integer >= 0, got '-1'"),
        ("--nproc=-2", "argument --nproc: expected an integer >= 1, got -2"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tiny_config, capsys, flag, expected):
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tiny_config()), flag])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plait: error: command line: ") and expected in err[0]


def test_tokens_per_s_and_measure_exclude_each_other(tiny_config, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tiny_config()), "--tokens-per-s=5", "--measure"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_measure_needs_the_data(tiny_config, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tiny_config()), "--config-only", f"--data.path={tmp_path / 'nodata'}", "--measure"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plait: error:")


def test_the_checkpoint_size_is_what_a_save_writes_and_async_saves_name_their_host_memory(tiny_config, tmp_path, capsys):
    """The plan's checkpoint size (fp32 weights, a tied weight once per name as DCP stores it, plus
    the optimizer state) is the size of a real checkpoint's shards; async saves add the host memory
    each rank keeps for the copy (its share of the state: under ddp the replicated tensors it writes, under fsdp2 its shard)."""
    import torch

    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    cfg = str(tiny_config(steps=2))
    t = Trainer(prepare(cfg, ["--checkpoint.every=2", f"--train.output_dir={tmp_path / 'run'}"]), DistInfo(device=torch.device("cpu")))
    t.build()
    assert t.fit() == 0
    capsys.readouterr()  # the run's own output
    shards = sum(f.stat().st_size for f in (tmp_path / "run" / "checkpoints" / "step_000000002").glob("*.distcp"))
    p = plan_json(capsys, "--config", cfg, "--nproc=2", "--checkpoint.async=true")
    c = p["checkpoint"]
    from torch.distributed.checkpoint import FileSystemReader

    items = len(FileSystemReader(str(tmp_path / "run" / "checkpoints" / "step_000000002")).read_metadata().storage_data)
    overhead = shards - c["size_gib"] * 2**30  # torch.save's zip framing of each stored tensor, a few KiB
    assert 0 <= overhead < 4096 * items, (shards, c["size_gib"] * 2**30, items)
    assert c["async"] and c["async_host_gib_per_rank"] == pytest.approx(c["size_gib"] / 2)  # ddp: each rank copies its share
    sharded = plan_json(capsys, "--config", cfg, "--nproc=2", "--checkpoint.async=true", "--parallelism.name=fsdp2")["checkpoint"]
    assert sharded["async_host_gib_per_rank"] == pytest.approx(c["size_gib"] / 2)
    assert plan_json(capsys, "--config", cfg)["checkpoint"]["async_host_gib_per_rank"] == 0.0
    text = plan_text(capsys, "--config", cfg, "--checkpoint.async=true", "--checkpoint.every=2")
    assert "  checkpoint  " in text and "every 2 steps" in text and "of host memory per rank for the run" in text
    # the folder every rank writes into, and on several ranks what it must be (this plan cannot look at other nodes)
    assert f"(pinned on CUDA), in {tmp_path / 'out' / 'checkpoints'}\n" in text and "on several nodes" not in text
    assert p["checkpoint"]["dir"] == str(tmp_path / "out" / "checkpoints")
    assert "on several nodes: one folder every node mounts (shared storage)" in plan_text(capsys, "--config", cfg, "--nproc=2")


def same_items(path, items: int):
    """A task file of ``items`` identical examples: an 18-byte context, four 4-byte continuations (bytes tokens)."""
    line = json.dumps({"context": "The cat sat on the", "continuations": [" mat", " hat", " bat", " cat"], "gold": 0})
    path.write_text((line + "\n") * items)
    return str(path)


def downstream(task: str, every: int) -> list[str]:
    return ['--monitors.enabled=["console", "downstream"]', f'--monitors.downstream.tasks=["{task}"]', f"--monitors.downstream.every={every}"]


def test_evaluation_cost_scales_with_the_items_the_interval_and_the_throughput(tiny_config, tmp_path, capsys):
    cfg = str(tiny_config(steps=6))  # 1024 tokens/step, seq 128, micro 2
    eight, sixteen = same_items(tmp_path / "eight.jsonl", 8), same_items(tmp_path / "sixteen.jsonl", 16)
    p = plan_json(capsys, "--config", cfg, *downstream(eight, 3), "--tokens-per-s=1000")
    (d,) = p["evaluation"]["passes"]
    # a row per choice: context + continuation - 1 = 21 input tokens, batches of 16 rows, no padding
    assert (d["name"], d["items"], d["requests"], d["forward_tokens"], d["forwards"]) == ("downstream", 8, 32, 8 * 4 * 21, 2)
    assert d["passes"] == 2  # steps 3 and 6
    fpt0 = p["seq_len_stages"][0]["flops_per_token"]
    assert d["seconds_per_pass"] == pytest.approx(d["flops_per_pass"] / (1000 * fpt0))
    assert p["evaluation"]["fraction_of_training"] == pytest.approx(d["flops"] / p["total_flops"])
    double = plan_json(capsys, "--config", cfg, *downstream(sixteen, 3), "--tokens-per-s=1000")["evaluation"]
    assert double["passes"][0]["forward_tokens"] == 2 * d["forward_tokens"]
    assert double["passes"][0]["seconds_per_pass"] == pytest.approx(2 * d["seconds_per_pass"])
    assert double["fraction_of_training"] == pytest.approx(2 * p["evaluation"]["fraction_of_training"])
    often = plan_json(capsys, "--config", cfg, *downstream(eight, 1), "--tokens-per-s=1000")["evaluation"]
    assert often["passes"][0]["passes"] == 6 and often["seconds"] == pytest.approx(3 * p["evaluation"]["seconds"])
    assert plan_json(capsys, "--config", cfg, *downstream(eight, 4))["evaluation"]["passes"][0]["passes"] == 2  # step 4 and the final step 6
    faster = plan_json(capsys, "--config", cfg, *downstream(eight, 3), "--tokens-per-s=2000")["evaluation"]
    assert faster["seconds"] == pytest.approx(p["evaluation"]["seconds"] / 2)
    assert plan_json(capsys, "--config", cfg, *downstream(eight, 3))["evaluation"]["seconds"] is None  # no throughput: no seconds
    text = plan_text(capsys, "--config", cfg, *downstream(eight, 3), "--tokens-per-s=1000")
    assert "  evaluation  downstream every 3 steps and at the end: 2 passes of 8 items, 32 sequences, 672 forward tokens" in text
    assert "% of the training FLOPs and time" in text


def test_validation_cost_is_its_micro_batches_on_every_data_rank(tiny_config, capsys):
    cfg = str(tiny_config(steps=6))
    one = plan_json(capsys, "--config", cfg, "--validation.every=4", "--validation.batches=3")["evaluation"]["passes"]
    two = plan_json(capsys, "--config", cfg, "--validation.every=4", "--validation.batches=3", "--nproc=2")["evaluation"]["passes"]
    assert [(v["name"], v["passes"], v["forward_tokens"], v["items"]) for v in one] == [("validation", 2, 3 * 2 * 128, 3)]
    assert two[0]["forward_tokens"] == 2 * one[0]["forward_tokens"]
    assert plan_json(capsys, "--config", cfg)["evaluation"]["passes"] == []  # nothing evaluated


def test_evaluation_cost_of_unreadable_task_files_is_unknown_not_guessed(tiny_config, tmp_path, capsys):
    cfg = str(tiny_config(steps=6))
    assert main(["--config", cfg, *downstream(str(tmp_path / "missing.jsonl"), 3), "--tokens-per-s=1000", "--json"]) == 2
    ev = json.loads(capsys.readouterr().out)["evaluation"]
    (d,) = ev["passes"]
    assert "unknown" in d and "forward_tokens" not in d and ev["unknown"] == ["downstream"] and ev["flops"] == 0
