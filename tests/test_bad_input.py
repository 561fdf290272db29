"""Every kind of bad input exits with code 2 and one clear line, before any process group or model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, run_module, write_tiny_config


def train(*args):
    return run_module("core.train", *args, timeout=60)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


def test_missing_config_file(tmp_path):
    assert "config file" in one_error_line(train("--config", str(tmp_path / "nope.toml")))


def test_unknown_key_with_suggestion(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--optimizer.lrr=1e-3"))
    assert "[optimizer]" in msg and "'lrr'" in msg and "did you mean 'lr'" in msg


def test_unknown_section(tiny_config):
    assert "unknown section [optimiser]" in one_error_line(train("--config", str(tiny_config()), "--optimiser.lr=1"))


def test_an_override_without_a_section_is_named(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--steps=5"))
    assert msg == "plait: error: command line: '--steps=5' names no section; expected --section.key=value (did you mean --train.steps?)"


def test_wrong_type(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), '--train.steps="ten"'))
    assert "[train].steps: expected int, got str" in msg


def test_unknown_plugin_lists_installed_and_closest(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--optimizer.name=adamw2"))
    assert "no optimizer plugin named 'adamw2'" in msg and "did you mean 'adamw'" in msg and "installed: " in msg


def test_extends_cycle(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    assert "extends cycle" in one_error_line(train("--config", str(tmp_path / "a.toml")))


def test_indivisible_batch_shows_numbers(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--train.global_batch_tokens=1000"))
    assert "1000 is not divisible by train.micro_batch (2) x data.seq_len (128) x world size (1) = 256" in msg


def test_data_missing(tiny_config, tmp_path):
    msg = one_error_line(train("--config", str(tiny_config()), f"--data.path={tmp_path / 'nodata'}"))
    assert "nodata" in msg and "does not exist" in msg


def test_token_ids_beyond_vocab(tiny_config, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(d / "train.bin")
    msg = one_error_line(train("--config", str(tiny_config()), f"--data.path={d}", "--model.vocab_size=600"))
    assert "train.bin holds token id 999, not below the model's vocabulary 600" in msg


def test_plugin_that_fails_to_import_names_plugin_and_distribution(tmp_path, tiny_config):
    site = tmp_path / "site"
    pkg = site / "broken_plait_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    dist = site / "broken_plait_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plait-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[plait]\nbroken = broken_plait_plugin\n")
    import os

    env = {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = run_module("core.train", "--config", str(tiny_config()), extra_env=env)
    msg = one_error_line(proc)
    assert "plugin 'broken' (distribution broken-plait-plugin" in msg and "boom at import" in msg
    # the allow-list leaves it out
    proc = run_module("core.plugins", extra_env={**env, "PLAIT_PLUGINS": ""})
    assert proc.returncode == 0, proc.stderr


def test_duplicate_component_across_distributions(tmp_path, tiny_config):
    site = tmp_path / "site"
    pkg = site / "dup_plait_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from core.contract.hookspecs import hookimpl\n"
        "from plugins.optim.adamw import AdamW, AdamWOptions\n"
        "@hookimpl\n"
        "def plait_register(registry):\n"
        "    registry.add('optimizer', 'adamw', AdamW, options=AdamWOptions, doc='a copy')\n"
    )
    dist = site / "dup_plait_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dup-plait-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[plait]\ndup = dup_plait_plugin\n")
    import os

    proc = run_module("core.plugins", extra_env={"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    msg = one_error_line(proc)
    assert "optimizer 'adamw' is claimed twice" in msg and "distribution plait" in msg and "distribution dup-plait-plugin" in msg


# --- bad input found before anything is built, in-process and cheap ---------------------------


def plan_error(capsys, *args: str) -> str:
    """``python -m core.plan`` in this process: exit code 2 and one ``plait: error:`` line. Input that
    makes a plan impossible prints nothing else; a missing or unusable data file or checkpoint is
    listed under the whole plan, which is printed."""
    from core.cli import plan

    capsys.readouterr()
    try:
        code = plan.main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    assert code == 2, out
    lines = [l for l in out.err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), out.err
    if out.out:  # the plan, and the problem under it
        assert out.out.startswith("plan for ") and "  parameters  " in out.out, out.out
        assert "  problems    " + lines[0].removeprefix("plait: error: ") in out.out, out.out
    return lines[0]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--optimizer.betas=[1.5, 0.99]"], "[optimizer] (optimizer 'adamw').betas: each must be >= 0 and < 1, got 1.5"),
        (["--optimizer.lr=nan"], ".lr: expected a number, got nan"),
        (["--optimizer.lr=inf"], ".lr: must be a finite number > 0, got inf"),
        (
            ["--precision.name=mxfp8", "--precision.emulate=true", "--model.dim=48", "--model.ffn_dim=80"],
            "mxfp8: the model has no linear layer with dimensions divisible by 32",  # found after the model was built, before
        ),
        (["--model.norm_eps=inf"], ".norm_eps: must be a finite number > 0, got inf"),  # its bound declared now; unbounded, it once said "must be , got inf"
        (["--monitors.jsonl.filename=."], "filename: expected a file name inside train.output_dir, got '.' (a folder)"),
        (["--monitors.jsonl.filename=config.resolved.toml"], "'config.resolved.toml' is where plait keeps its own config.resolved.toml"),
        (["--optimizer.eps=-1"], ".eps: must be > 0, got -1"),
        (["--optimizer.weight_decay=nan"], ".weight_decay: expected a number, got nan"),
        (["--optimizer.lr_multipliers={embedding = -0.5}"], ".lr_multipliers: each must be >= 0, got -0.5"),
        (["--optimizer.name=adamw8bit", "--optimizer.betas=[0.9, 1.0]"], "(optimizer 'adamw8bit').betas: each must be >= 0 and < 1, got 1.0"),
        (["--train.grad_clip=nan"], "[train].grad_clip: expected a number, got nan"),
        (["--lr_schedule.warmup_fraction=nan"], ".warmup_fraction: expected a number, got nan"),
        (["--lr_schedule.name=wsd", "--lr_schedule.decay_fraction=nan"], ".decay_fraction: expected a number, got nan"),
        (
            ['--monitors.enabled=["console", "seq_len_stages"]', "--monitors.seq_len_stages.stages=[[0.0, 128], [nan, 64]]"],
            "[monitors.seq_len_stages].stages: expected a number, got nan",
        ),
        (["--model.loss_chunk_tokens=-1"], ".loss_chunk_tokens: must be >= 0, got -1"),
        (["--train.seed=-1"], "[train].seed: must be >= 0 and <= 4294967295, got -1"),
        # a "never time out" value: torchrun's store timed out at once (int64 nanoseconds), or a traceback
        (["--train.collective_timeout_s=10000000000"], "[train].collective_timeout_s: must be > 0 and <= 100000000, got 10000000000"),
        # a stall timeout that ends every run at once as 'stalled' (restarted by launchers), or one that overflows a wait
        (["--train.stall_timeout_s=1e-9"], "[train]: stall_timeout_s: expected 0 (off) or at least 1 second, got 1e-09"),
        (["--train.stall_timeout_s=1e300"], "[train].stall_timeout_s: must be >= 0 and <= 100000000, got 1e+300"),
        (["--train.seed=4294967296"], "[train].seed: must be >= 0 and <= 4294967295, got 4294967296"),
        (["--train.steps=1000000000"], "[train].steps: must be >= 0 and <= 999999999, got 1000000000"),
        (["--train.steps=0", "--train.target_tokens=9000000000000000000"], "expected at most 999999999 steps"),
        (['--monitors.enabled=["console", "jsonl", "console"]'], "[monitors].enabled lists 'console' twice"),
        (["--validation.every=2", "--validation.split=test"], "the data source has no 'test' split"),
        (["--monitors.jsonl.filename=../../x"], "[monitors.jsonl].filename: expected a relative path inside its folder, got '../../x'"),
        (["--monitors.jsonl.filename=/tmp/x.jsonl"], "expected a relative path inside its folder, got '/tmp/x.jsonl' (absolute)"),
        (["--data.train_file=../train.bin"], ".train_file: expected a relative path inside its folder"),
        (['--monitors.enabled=["budget_guard"]', "--monitors.budget_guard.cap_usd=-1"], "[monitors.budget_guard].cap_usd: must be >= 0, got -1"),
        (["--checkpoint.dir=/proc/x"], "[checkpoint].dir = /proc/x: cannot create or write a file there"),
        (["--train.output_dir=/proc/y"], "[train].output_dir = /proc/y: cannot create or write a file there"),
        (["--train.output_dir="], "[train]: output_dir: expected a folder, got an empty string"),  # an unset shell variable
        (["--checkpoint.resume="], "[checkpoint]: resume: expected 'auto', 'none' or a checkpoint folder, got an empty string"),
        (["--=5"], "command line: bad key in '--=5'"),
        (['--monitors.enabled=["spikes"]', "--monitors.spikes.max_in_a_row=-1"], "[monitors.spikes].max_in_a_row: must be >= 0, got -1"),
        (['--monitors.enabled=["spikes"]', "--monitors.spikes.sigmas=-1"], "[monitors.spikes].sigmas: must be > 0, got -1"),
        (['--monitors.enabled=["spikes"]', "--monitors.spikes.window=1"], "[monitors.spikes].window: must be >= 2, got 1"),
        (["--checkpoint.keep_latest=-1"], "[checkpoint].keep_latest: must be >= 0, got -1"),
        (["--parallelism.name=ddp", "--parallelism.bucket_cap_mb=-1"], "(parallelism 'ddp').bucket_cap_mb: must be > 0, got -1"),
        (["--steps=5"], "command line: '--steps=5' names no section; expected --section.key=value (did you mean --train.steps?)"),
        (["--keep-latest", "2"], "(did you mean --checkpoint.keep_latest?)"),
        (["--bogus"], "command line: '--bogus' names no section; expected --section.key=value"),
        (["--nproc", "x"], "command line: argument --nproc: invalid int value: 'x'"),
        # a zero epsilon turns the first update of every parameter with a zero gradient into NaN
        (["--optimizer.eps=0"], "(optimizer 'adamw').eps: must be > 0, got 0"),
        (["--optimizer.name=adamw8bit", "--optimizer.eps=0"], "(optimizer 'adamw8bit').eps: must be > 0, got 0"),
        (['--monitors.enabled=["budget_guard"]', "--monitors.budget_guard.stale_after_s=-1"], "stale_after_s: must be > 0, got -1"),
        # shapes that would loop for hours building the model, or ask for terabytes, before any check
        (["--model.n_layers=1000000000000"], "make 8.61e+16 parameters; expected at most 1e+13"),
        (["--model.dim=1000000000000"], "n_layers 2, dim 1000000000000, ffn_dim 384 and vocab_size 512 make 6e+24 parameters"),
        (["--model.max_seq_len=1000000000000"], "max_seq_len must be at most 16,777,216 (2^24), got 1,000,000,000,000"),
        (["--model.name=recurrent_moe", "--model.n_experts=1000000000000"], "n_experts 1000000000000 of 3 layers and vocab_size 512 make 7.39e+16"),
        # document masking and the MoE's routing (issue 33)
        (["--model.attention_mask=diagonal"], "(model 'llama3').attention_mask: expected 'causal' | 'document', got str 'diagonal'"),
        (["--data.name=synthetic", "--model.attention_mask=document"], '[model].attention_mask = "document" needs the end-of-document id of the data'),
        (["--model.rope_positions=document"], 'rope_positions = "document" needs attention_mask = "document"'),
        (["--model.name=recurrent_moe", "--model.capacity_factor=0.5"], "capacity_factor 0.5: expected 0 (dropless) or at least 1"),
        (["--model.name=recurrent_moe", "--model.top_k=5"], "top_k 5: expected 1 to n_experts (4)"),
    ],
)
def test_plan_refuses_bad_values(tiny_config, capsys, overrides, expected):
    assert expected in plan_error(capsys, "--config", str(tiny_config()), *overrides)


def test_mixture_without_a_validation_split_names_the_source(tiny_config, tmp_path, capsys):
    """validation.every on a mixture said only 'the data source has no 'val' split', not which source lacks it."""
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    shakespeare = REPO / "plugins" / "data" / "corpus" / "shakespeare"
    sources = f'[{{name="token_bin", weight=1.0, label="bard", path="{shakespeare}"}}, {{name="text_stream", weight=1.0, label="web", files=["{tmp_path / "docs.jsonl"}"]}}]'
    msg = plan_error(capsys, "--config", str(tiny_config()), "--data.name=mixture", f"--data.sources={sources}", "--validation.every=2")
    assert msg.endswith("validation.every = 2 but the data source has no 'val' split (source 'web' of the mixture: no 'val' split)")


def test_output_folder_that_is_a_file(tiny_config, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    msg = plan_error(capsys, "--config", str(tiny_config()), f"--train.output_dir={tmp_path / 'afile' / 'out'}")
    assert "afile is a file, expected a folder" in msg


def test_plan_probe_removes_only_what_it_created(tiny_config, tmp_path, capsys):
    from core.cli import plan
    from core.runtime.made_folders import probe_folder

    (tmp_path / "keep").mkdir()
    out = tmp_path / "keep" / "a" / "b"
    assert plan.main(["--config", str(tiny_config()), f"--train.output_dir={out}"]) == 0
    assert not (tmp_path / "keep" / "a").exists() and (tmp_path / "keep").is_dir()
    assert list((tmp_path / "keep").iterdir()) == []
    probe_folder(out, "[train].output_dir")  # core.train's probe keeps the folders for the run, not the probe file
    assert out.is_dir() and list(out.iterdir()) == []


def test_bad_resume_or_initial_load_leaves_no_run_folder_behind(tiny_config, tmp_path):
    """A checkpoint.resume that does not exist is found before anything is created: no output_dir,
    checkpoints folder or plait.lock is left behind. initial_load
    can only be checked once no checkpoint is found to resume from (after the folders exist):
    its failure removes the folders this start made, and nothing that was there before."""
    from core.contract.errors import PlaitError
    from core.preflight.prepare import prepare
    from core.runtime.ownership import release_run_folders

    out = tmp_path / "runs" / "a" / "out"
    msg = one_error_line(train("--config", str(tiny_config()), f"--train.output_dir={out}", f"--checkpoint.resume={tmp_path / 'nope'}"))
    assert "nope does not exist" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # not even runs/

    def start(output_dir):  # what core.train's rank 0 prepares (the lock included), in this process
        with pytest.raises(PlaitError, match=r"weights .*nope not found"):
            prepare(str(tiny_config()), [f"--train.output_dir={output_dir}", f"--checkpoint.initial_load={tmp_path / 'nope'}"], lock=True)
        release_run_folders()

    start(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]
    (tmp_path / "mine").mkdir()  # folders that were there before stay, with what they hold
    (tmp_path / "mine" / "notes.txt").write_text("x")
    start(tmp_path / "mine")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt", "plait.lock"]


def test_resume_checkpoint_checked_by_plan(tiny_config, tmp_path, capsys):
    msg = plan_error(capsys, "--config", str(tiny_config()), f"--checkpoint.resume={tmp_path / 'nope'}")
    assert "checkpoint" in msg and "nope does not exist" in msg


def test_data_checked_by_plan(tiny_config, tmp_path, capsys):
    msg = plan_error(capsys, "--config", str(tiny_config()), f"--data.path={tmp_path / 'nodata'}")
    assert "nodata" in msg and "does not exist" in msg
    (tmp_path / "afile.bin").write_bytes(b"\0" * 16)
    msg = plan_error(capsys, "--config", str(tiny_config()), f"--data.path={tmp_path / 'afile.bin'}")
    assert "afile.bin is a file; expected a folder holding train.bin" in msg


def test_a_stopping_stream_with_a_window_but_not_a_step_is_refused_by_plan(tiny_config, tmp_path, capsys):
    """on_end = "stop" and a file of one window, with a micro-batch of 2: not a run that ends at step 0
    with exit 0 (data_end); preflight refuses it, so core.plan (and launchers) do too."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "x" * 200}) + "\n")  # 201 tokens: one window of 129
    files = f'--data.files=["{tmp_path / "one.jsonl"}"]'
    msg = plan_error(capsys, "--config", str(tiny_config()), "--data.name=text_stream", files, '--data.on_end="stop"')
    assert "one.jsonl holds 1 window(s) of data.seq_len + 1 = 129 tokens for rank 0 of 1" in msg
    assert "train.micro_batch 2 x accumulation 4 = 8" in msg and "would end the run at step 0" in msg


def test_an_unbounded_float_must_still_be_finite():
    """Once said "must be , got inf" (the case was llama3's norm_eps, whose bound is declared now)."""
    from core.contract.option_values import check_value

    assert check_value("x", float("inf"), {}) == "x: must be a finite number, got inf"


def test_bounds_are_listed_by_core_plugins():
    from core.contract.options import describe
    from plugins.optim.adamw import AdamWOptions

    docs = {name: doc for name, _tp, _default, doc in describe(AdamWOptions)}
    assert docs["betas"].endswith("(each >= 0 and < 1)") and docs["lr"].endswith("(> 0)")


# --- configs and the command line ----------------------------------------------------------------


def test_config_nested_thousands_deep_is_one_error(tmp_path):
    from core.config import files as config_io
    from core.contract.errors import ConfigError

    (tmp_path / "arrays.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        config_io.load(tmp_path / "arrays.toml")
    (tmp_path / "tables.toml").write_text("[" + ".".join(["t"] * 3000) + "]\nx = 1\n")
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        config_io.load(tmp_path / "tables.toml")
    (tmp_path / "ok.toml").write_text("[train]\nsteps = 1\n")
    with pytest.raises(ConfigError, match="command line: an override nests more than 64"):
        config_io.load(tmp_path / "ok.toml", ["--" + ".".join(["k"] * 3000) + "=1"])


def test_extends_chain_of_a_thousand_files(tmp_path):
    from core.config import files as config_io
    from core.contract.errors import ConfigError

    for i in range(1000):
        (tmp_path / f"c{i}.toml").write_text(f'extends = "c{i + 1}.toml"\n' if i < 999 else "[train]\nsteps = 1\n")
    with pytest.raises(ConfigError, match="extends chain longer than 64 files"):
        config_io.load(tmp_path / "c0.toml")
    assert config_io.load(tmp_path / "c960.toml") == {"train": {"steps": 1}}  # 40 files are fine


def test_train_argparse_errors_are_one_line(capsys):
    from core.cli import train

    with pytest.raises(SystemExit) as exc:
        train.main(["--config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert err[0].startswith("plait: error: command line: argument --config: expected one argument")


def test_plugins_argparse_errors_are_one_line(capsys):
    """core.plugins printed argparse's usage block and its own prefix, unlike every other command."""
    from core.cli import plugins

    with pytest.raises(SystemExit) as exc:
        plugins.main(["--slot", "modle"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert err[0].startswith("plait: error: command line: argument --slot: invalid choice: 'modle'")


def test_train_records_bad_input_for_launchers(tiny_config, tmp_path, capsys, monkeypatch):
    """Under torchrun a child's exit code 2 becomes 1: exit_status.json tells remote.sh not to retry."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from core.cli import train

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as exc:
        train.main(["--config", str(tiny_config()), "--optimizer.eps=-1"])
    assert exc.value.code == 2
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["exit_code"] == 2 and status["reason"] == "bad_input" and "eps" in status["detail"]
    # torchrun's failure summary names the reason, read from the error file it gave the rank
    line = capsys.readouterr().err.strip()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    summary = ChildFailedError("core.train", {0: failure}).format_msg()
    assert line.startswith("plait: error:") and f"traceback : {line}" in summary and "To enable traceback" not in summary


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--optimizer.betas=[1.5, 0.99]"], "betas: each must be >= 0 and < 1, got 1.5"),
        (["--checkpoint.dir=/proc/x"], "[checkpoint].dir = /proc/x: cannot create or write a file there"),
        (["--=5"], "bad key in '--=5'"),
    ],
)
def test_train_exits_2_with_one_line(tiny_config, args, expected):
    assert expected in one_error_line(train("--config", str(tiny_config()), *args))


# --- data -----------------------------------------------------------------------------------------


def token_bin_source(d, **opts):
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    return TokenBin(TokenBinOptions(path=str(d), **opts))


def test_token_bin_uint32_read_as_uint16_is_refused(tmp_path):
    from core.contract.errors import DataError

    d = tmp_path / "data"
    d.mkdir()
    np.random.default_rng(0).integers(1, 500, 4000).astype(np.uint32).tofile(d / "train.bin")
    with pytest.raises(DataError, match="every other uint16 token is 0 .* looks like uint32 data read as uint16"):
        token_bin_source(d).validate(512, 32)
    with pytest.raises(DataError, match="looks like uint32"):
        token_bin_source(d, dtype="uint16").validate(512, 32)
    token_bin_source(d, dtype="uint32").validate(512, 32)  # read right, it is fine
    (d / "meta.json").write_text('{"dtype": "uint32"}')
    token_bin_source(d).validate(512, 32)
    (d / "meta.json").write_text('{"dtype": "uint16"}')  # the file says so: believed
    token_bin_source(d).validate(512, 32)


@pytest.mark.parametrize("meta", ["[1, 2]", '"uint16"', "{oops"])
def test_token_bin_malformed_meta_is_one_error(tmp_path, meta):
    from core.contract.errors import DataError

    d = tmp_path / "data"
    d.mkdir()
    np.arange(1, 1000, dtype=np.uint16).tofile(d / "train.bin")
    (d / "meta.json").write_text(meta)
    with pytest.raises(DataError, match="meta.json: (expected a JSON object|not valid JSON)"):
        token_bin_source(d).validate(1024, 32)


def test_token_bin_file_shorter_than_meta_json_says_is_refused(tmp_path):
    """A train.bin cut short at a whole token (an interrupted copy) still fits the dtype: the token
    counts prepare writes in meta.json catch it, for either split, before training."""
    from core.contract.errors import DataError

    d = tmp_path / "data"
    d.mkdir()
    np.arange(1, 1001, dtype=np.uint16).tofile(d / "train.bin")
    np.arange(1, 201, dtype=np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 1024, "tokens": {"train": 1000, "val": 200}}))
    token_bin_source(d).validate(1024, 32)  # as prepared: fine
    with open(d / "train.bin", "r+b") as f:
        f.truncate(600 * 2)
    with pytest.raises(DataError, match=r"train.bin holds 600 tokens, but .*meta.json says tokens.train = 1000: truncated\?"):
        token_bin_source(d).validate(1024, 32)
    np.arange(1, 1001, dtype=np.uint16).tofile(d / "train.bin")
    np.arange(1, 301, dtype=np.uint16).tofile(d / "val.bin")  # a val.bin from another preparation
    with pytest.raises(DataError, match=r"val.bin holds 300 tokens, but .*tokens.val = 200: not the file meta.json describes"):
        token_bin_source(d).validate(1024, 32)
    (d / "val.bin").rename(d / "other.bin")
    token_bin_source(d, val_file="other.bin").validate(1024, 32)  # the counts describe prepare's file names only


def test_unknown_split_is_no_split(tmp_path):
    from plugins.data.synthetic import Synthetic, SyntheticOptions

    assert token_bin_source(REPO / "plugins" / "data" / "corpus" / "shakespeare").has_split("val")
    assert not token_bin_source(REPO / "plugins" / "data" / "corpus" / "shakespeare").has_split("test")
    assert Synthetic(SyntheticOptions()).has_split("val") and not Synthetic(SyntheticOptions()).has_split("test")


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"text": 5}\n', r"a.jsonl:1: 'text' is int '5', expected a string"),
        ('{"text": "ok"}\n{"body": "x"}\n', r"a.jsonl:2: not a JSON object with a 'text' string \(KeyError"),
        ('{"text": "ok"}\n{oops\n', r"a.jsonl:2: not a JSON object with a 'text' string \(JSONDecodeError"),
        ("[1, 2]\n", r"a.jsonl:1: not a JSON object"),
        ("", r"a.jsonl holds no document \(empty file\)"),
        ("\n\n", r"a.jsonl holds no document"),
    ],
)
def test_text_stream_checks_first_records_before_training(tmp_path, content, expected):
    from core.contract.errors import DataError
    from plugins.data.text_stream import TextStream, TextStreamOptions

    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(DataError, match=expected):
        TextStream(TextStreamOptions(files=[str(tmp_path / "a.jsonl")])).validate(512, 32)


def test_text_stream_parquet_column_checked(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from core.contract.errors import DataError
    from plugins.data.text_stream import TextStream, TextStreamOptions

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match="a.parquet: no column 'text'; columns: body"):
        TextStream(TextStreamOptions(files=[str(tmp_path / "a.parquet")])).validate(512, 32)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match="column 'text' holds int values, expected strings"):
        TextStream(TextStreamOptions(files=[str(tmp_path / "b.parquet")])).validate(512, 32)
    (tmp_path / "c.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="c.parquet: not a readable parquet file"):
        TextStream(TextStreamOptions(files=[str(tmp_path / "c.parquet")])).validate(512, 32)


@pytest.mark.parametrize(
    "table, expected",
    [
        ({"workers": -1}, r"\[data\].workers: must be >= 0, got -1"),
        ({"shuffle_buffer": -2}, r"\[data\].shuffle_buffer: must be >= 0, got -2"),
    ],
)
def test_text_stream_negative_counts(table, expected):
    from core.contract.errors import ConfigError
    from core.contract.option_values import build_options
    from plugins.data.text_stream import TextStreamOptions

    with pytest.raises(ConfigError, match=expected):
        build_options(TextStreamOptions, table, "[data]")


def test_text_stream_resume_with_other_workers_is_refused():
    from core.contract.errors import DataError
    from plugins.data.text_stream import TextStream, TextStreamOptions

    saved = {"world_size": 2, "config": {"data": {"name": "text_stream", "workers": 2}}}
    TextStream(TextStreamOptions(workers=2)).check_resume(saved, 2)
    with pytest.raises(DataError, match=r"saved with 2 ranks x workers = 2, this run has 2 x workers = 1"):
        TextStream(TextStreamOptions(workers=1)).check_resume(saved, 2)
    with pytest.raises(DataError, match=r"this run has 4 x workers = 2"):
        TextStream(TextStreamOptions(workers=2)).check_resume(saved, 4)


# --- weights --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "shards/../../x.safetensors"])
def test_hf_index_paths_must_stay_in_the_folder(tmp_path, name):
    import json

    from core.checkpoint.weights import HF_INDEX, hf_index_files
    from core.contract.errors import CheckpointError

    (tmp_path / HF_INDEX).write_text(json.dumps({"weight_map": {"a.weight": "model-1.safetensors", "b.weight": name}}))
    with pytest.raises(CheckpointError, match="weight_map names .* expected a file inside"):
        hf_index_files(tmp_path / HF_INDEX)
    (tmp_path / HF_INDEX).write_text('{"weight_map": [1]}')
    with pytest.raises(CheckpointError, match="expected a JSON object with a weight_map"):
        hf_index_files(tmp_path / HF_INDEX)


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_initial_load_export_of_another_shape_is_refused_by_plan(tiny_config, tmp_path, capsys, fmt):
    """An export's keys and shapes are checked from its headers before training (core.plan too), as a
    checkpoint folder's are, before the process group and model exist."""
    import torch

    from core.checkpoint.weights import empty_model, save_hf, save_safetensors, spec_from_config

    section = {"name": "llama3", "flavor": "debug", "dim": 32, "n_layers": 2}  # the tiny config's model has dim 64
    spec = spec_from_config({"model": section}, "test")
    sd = {k: torch.zeros(v.shape) for k, v in empty_model(spec).state_dict().items()}
    out = tmp_path / fmt
    save_safetensors(sd, out, section, None) if fmt == "safetensors" else save_hf(spec, sd, out, None, 2**30)
    msg = plan_error(capsys, "--config", str(tiny_config()), f"--checkpoint.initial_load={out}")
    assert f"weights {out} do not fit the model: " in msg and "vs model (64, 64)" in msg


def test_initial_load_hf_index_checked_before_training(tiny_config, tmp_path, capsys):
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    msg = plan_error(capsys, "--config", str(tiny_config()), f"--checkpoint.initial_load={hf}")
    assert "weight_map names '../secret.safetensors'" in msg


# --- launchers/remote.sh: numbers from the environment ------------------------------------------


@pytest.mark.parametrize(
    "var, value", [("MICRO_BATCH", "HOME[$(touch {marker})]"), ("GRAD_ACCUM", "PATH[$(touch {marker})]"), ("BACKOFF_S", "08"), ("NPROC", "2; touch {marker}")]
)
def test_remote_refuses_non_numeric_environment(tmp_path, var, value):
    import os
    import subprocess
    import sys

    marker = tmp_path / "pwned"
    e = dict(os.environ, PYTHON=sys.executable, OUTPUT_DIR=str(tmp_path / "out"), MICRO_BATCH="2", SEQ_LEN="128", GRAD_ACCUM="1")
    e[var] = value.format(marker=marker)
    proc = subprocess.run(["bash", "launchers/remote.sh"], cwd=REPO, env=e, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"plait: error: remote.sh: {var} = " in proc.stderr and "expected a non-negative decimal integer" in proc.stderr
    assert not marker.exists() and "torch " not in proc.stdout  # refused before python or arithmetic ran


def test_plan_config_only_skips_data_checks(tiny_config, tmp_path, capsys):
    from core.cli import plan

    args = ["--config", str(tiny_config()), f"--data.path={tmp_path / 'elsewhere'}"]
    assert "does not exist" in plan_error(capsys, *args)
    assert plan.main([*args, "--config-only"]) == 0


def test_a_model_larger_than_this_machine_is_refused_before_the_run_on_cpu(tiny_config):
    """vocab_size typed a thousand times too large: 128 billion parameters on a CPU machine was an
    allocation traceback (exit 1, so a launcher restarted into it) after the process group was up."""
    from core.contract.errors import ConfigError
    from core.preflight.prepare import prepare

    with pytest.raises(ConfigError, match=r"the model's 128,000,332,992 parameters need 953.7 GiB per rank .* this machine has"):
        prepare(str(tiny_config()), ["--model.name=recurrent_moe", "--model.vocab_size=1000000000"], validate_data=True)
    prepare(  # plan: maybe for another machine's memory (its 1.4 TB checkpoint would not fit this disk: none asked for)
        str(tiny_config()), ["--model.name=recurrent_moe", "--model.vocab_size=1000000000", "--checkpoint.at_end=false"], validate_data=True, dry_run=True
    )


def test_a_bad_value_from_the_command_line_is_named_as_such(tiny_config, tmp_path, capsys):
    """The line named the config file for a value that is not in it: `--train.steps=abc` read
    "run.toml: [train].steps: expected int, got str 'abc'". It still names the file (the run) and now
    says where the value came from; a value that is in the file gets no such note."""
    config = str(tiny_config())
    for flag, said in [
        ("--train.steps=abc", "[train].steps: expected int, got str 'abc'"),
        ("--optimizer.lr=-1", "[optimizer] (optimizer 'adamw').lr: must be > 0, got -1"),
        ("--train.stepz=5", "[train]: unknown key 'stepz' (did you mean 'steps'?)"),
    ]:
        msg = plan_error(capsys, "--config", config, flag, "--train.seed=1")
        assert said in msg and msg.endswith(f" (given on the command line: {flag.split('=')[0]})"), msg
    msg = plan_error(capsys, "--config", config, "--train.micro_batch=0")
    assert "[train].micro_batch" in msg and msg.endswith("(given on the command line: --train.micro_batch)")
    in_file = tmp_path / "bad.toml"
    in_file.write_text(f'extends = "{config}"\n[optimizer]\nlr = -1\n')
    msg = plan_error(capsys, "--config", str(in_file), "--train.steps=5")
    assert msg.endswith("lr: must be > 0, got -1") and str(in_file) in msg  # from the file: no note


def test_a_config_of_megabytes_or_of_a_million_keys_is_one_line_unparsed(tmp_path, tiny_config):
    from core.config import files as config_io
    from core.contract.errors import ConfigError

    huge = tmp_path / "huge.toml"
    with huge.open("w") as f:  # 26 MB of keys: refused by its size, never parsed
        f.write("[train]\n")
        for i in range(1_500_000):
            f.write(f"k{i} = {i}\n")
    with pytest.raises(ConfigError, match=r"huge.toml: larger than 1 MiB"):
        config_io.load(huge)
    many = tmp_path / "many.toml"
    many.write_text("[train]\nk = [" + "1," * 150_000 + "]\n")  # under 1 MiB, past the count of values
    with pytest.raises(ConfigError, match=r"many.toml: more than 100000 keys and array items"):
        config_io.load(many)
    with pytest.raises(ConfigError, match=r"command line: longer than"):
        config_io.load(tiny_config(), ["--train.k=[" + "1," * 600_000 + "]"])
    parts = [tmp_path / f"part{i}.toml" for i in range(3)]  # each file under the count, the merge over it
    for i, p in enumerate(parts):
        p.write_text(f"[s{i}]\nk = [" + "1," * 40_000 + "]\n")
    (tmp_path / "top.toml").write_text(f"extends = {[p.name for p in parts]!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=r"top.toml: with its extends and overrides, more than 100000"):
        config_io.load(tmp_path / "top.toml")
    msg = one_error_line(train("--config", str(huge)))
    assert "huge.toml: larger than 1 MiB" in msg


def test_token_bin_uint32_ids_above_65535_read_as_uint16_are_refused(tmp_path):
    from core.contract.errors import DataError

    d = tmp_path / "data"
    d.mkdir()
    np.random.default_rng(0).integers(1, 128_000, 40_000).astype(np.uint32).tofile(d / "train.bin")  # a llama3-sized vocabulary
    with pytest.raises(DataError, match=r"every other uint16 token is at most 1 .* looks like uint32 data read as uint16 \(ids below 131072\)"):
        token_bin_source(d).validate(128_256, 32)
    token_bin_source(d, dtype="uint32").validate(128_256, 32)  # read right, it is fine
    np.random.default_rng(0).integers(1, 128_000, 40_000).astype(np.uint16).tofile(d / "train.bin")  # real uint16 ids
    token_bin_source(d).validate(128_256, 32)


def test_token_bin_ids_past_the_vocabulary_meta_json_declares_are_refused(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    np.random.default_rng(0).integers(1, 500, 40_000).astype(np.uint16).tofile(d / "train.bin")
    (d / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 300}')
    cfg = write_tiny_config(tmp_path)
    for module in ("core.train", "core.plan"):
        msg = one_error_line(run_module(module, "--config", str(cfg), f"--data.path={d}", timeout=60))
        assert "train.bin holds token id 499, not below the vocab_size 300 that" in msg and "meta.json declares" in msg, msg
    (d / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 500}')
    token_bin_source(d).validate(512, 32)
