"""Every kind of bad input exits with code 2 and one clear line, before any process group or model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO
from shared import plan_error, token_bin_source

# --- bad input found before anything is built, in-process and cheap ---------------------------


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


def test_removing_a_made_folder_keeps_the_lock_another_process_wrote_there(tmp_path):
    """Two ranks of one host start one run: the one whose start made the output folder is refused
    later and removes what its start made, while the other holds the folder's lock. The other's
    lock file stays, and with it the folder; this process's own lock file and empty folder go."""
    import subprocess
    import sys
    import time

    from core.runtime import ownership
    from core.runtime.made_folders import probe_folder, remove_created

    theirs, mine = tmp_path / "out", tmp_path / "mine"
    made = probe_folder(theirs, "[train].output_dir") + probe_folder(mine, "[checkpoint].dir")
    assert made == [theirs, mine]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from core.runtime import ownership; ownership.lock_run_folders([sys.argv[1]]); input()", str(theirs)],
        stdin=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        deadline = time.time() + 600
        while not ownership.held_elsewhere(theirs):
            assert holder.poll() is None and time.time() < deadline
            time.sleep(0.05)
        ownership.lock_run_folders([mine])
        assert ownership.held_here(mine) and not ownership.held_here(theirs)
        remove_created(made)
        assert (theirs / ownership.LOCK_FILE).is_file() and not mine.exists()
        assert ownership.held_elsewhere(theirs)
    finally:
        holder.communicate(b"\n", timeout=60)


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
    """A float option without declared bounds still refuses inf, naming the key and the value."""
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


def test_plugins_argparse_errors_are_one_line(capsys):
    """core.plugins printed argparse's usage block and its own prefix, unlike every other command."""
    from core.cli import plugins

    with pytest.raises(SystemExit) as exc:
        plugins.main(["--slot", "modle"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert err[0].startswith("plait: error: command line: argument --slot: invalid choice: 'modle'")


# --- data -----------------------------------------------------------------------------------------


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

    from core.contract.errors import CheckpointError
    from core.weights import HF_INDEX, hf_index_files

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

    from core.weights import empty_model, save_hf, save_safetensors, spec_from_config

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


def test_plan_config_only_skips_data_checks(tiny_config, tmp_path, capsys):
    from core.cli import plan

    args = ["--config", str(tiny_config()), f"--data.path={tmp_path / 'elsewhere'}"]
    assert "does not exist" in plan_error(capsys, *args)
    assert plan.main([*args, "--config-only"]) == 0


def test_a_model_larger_than_this_machine_is_refused_before_the_run_on_cpu(tiny_config):
    """A model far larger than this machine's memory (vocab_size typed a thousand times too large: 128 billion
    parameters on CPU) is refused in one line before the run starts; a plan (dry run), maybe for another machine, takes it."""
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


def test_token_bin_uint32_ids_of_a_vocabulary_over_262144_without_meta_json_are_refused(tmp_path):
    """Ids at or above 262,144 have a high half of 4 or more: with a 300,000-token vocabulary and no
    meta.json such a file was planned as uint16 without a word (every value below 65,536 passes the id
    check). The check allows the high halves the model's vocabulary can have, whatever its size."""
    from core.contract.errors import DataError

    d = tmp_path / "data"
    d.mkdir()
    np.random.default_rng(0).integers(262_144, 300_000, 40_000).astype(np.uint32).tofile(d / "train.bin")
    with pytest.raises(DataError, match=r"every other uint16 token is at most 4 .* looks like uint32 data read as uint16 \(ids below 327680\)"):
        token_bin_source(d).validate(300_000, 32)
    token_bin_source(d, dtype="uint32").validate(300_000, 32)  # read right, it is fine
    np.random.default_rng(0).integers(1, 65_535, 40_000).astype(np.uint16).tofile(d / "train.bin")  # real uint16 ids, the same vocabulary
    token_bin_source(d).validate(300_000, 32)
