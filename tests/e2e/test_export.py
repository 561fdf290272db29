"""Export to safetensors and Hugging Face layout, and starting a run from exported weights."""

from __future__ import annotations

import pytest
import torch
from conftest import main_here, read_metrics, run_module, torchrun


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run of a tiny untied model; returns (config path, its last checkpoint)."""
    tmp = tmp_path_factory.mktemp("export")
    cfg = tmp / "run.toml"
    from conftest import REPO

    cfg.write_text(f'''
extends = "{REPO / "train_configs" / "debug_cpu.toml"}"
[train]
steps = 3
global_batch_tokens = 512
micro_batch = 2
log_every = 1
output_dir = "{tmp / "run"}"
[model]
dim = 64
[data]
seq_len = 128
path = "{REPO / "plugins" / "data" / "corpus" / "shakespeare"}"
[monitors]
enabled = ["jsonl"]
''')
    proc = run_module("core.train", "--config", str(cfg))
    assert proc.returncode == 0, proc.stderr
    return cfg, tmp / "run" / "checkpoints" / "step_000000003"


def export(ckpt, fmt, out, *extra):
    """``python -m core.export`` in this process (the command line itself is tested in test_bad_paths_exit_2)."""
    from core.cli.export import main

    assert main(["--checkpoint", str(ckpt), "--format", fmt, "--out", str(out), *extra]) == 0
    return out


def test_safetensors_reloads_byte_for_byte(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    from core.weights import checkpoint_model

    _, ckpt = trained
    _, _, model = checkpoint_model(ckpt)
    capsys.readouterr()
    out = export(ckpt, "safetensors", tmp_path / "a")
    said = capsys.readouterr()
    lines = said.out.splitlines() + said.err.splitlines()  # the tools speak as the trainer does
    assert lines and all(line.startswith("plait: ") for line in lines), lines
    loaded = load_file(str(out / "model.safetensors"))
    for name, t in model.state_dict().items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    again = export(ckpt, "safetensors", tmp_path / "b")
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    bf16 = load_file(str(export(ckpt, "safetensors", tmp_path / "c", "--dtype", "bf16") / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_hf_export_loads_in_transformers_with_matching_logits(trained, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    from core.weights import checkpoint_model

    _, ckpt = trained
    _, _, model = checkpoint_model(ckpt)
    out = export(ckpt, "hf", tmp_path / "hf", "--shard-gb", "0.0005")  # several shards + index
    assert (out / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    ids = torch.randint(0, 257, (2, 64))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_a_qk_norm_model_exports_as_qwen3_with_matching_logits_and_starts_a_run(trained, tmp_path):
    """llama3 with qk_norm: safetensors holds the q/k norms, the hf export is a Qwen3ForCausalLM whose
    logits are plait's, and a run starts from that export with the safetensors export's first loss."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    from safetensors.torch import load_file

    from core.weights import checkpoint_model

    cfg, _ = trained
    run = tmp_path / "run"
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={run}", "--model.qk_norm=true")
    assert proc.returncode == 0, proc.stderr
    ckpt = run / "checkpoints" / "step_000000003"
    _, _, model = checkpoint_model(ckpt)
    st = load_file(str(export(ckpt, "safetensors", tmp_path / "st") / "model.safetensors"))
    assert st.keys() == model.state_dict().keys() and "layers.1.attention.q_norm.weight" in st
    assert not torch.equal(st["layers.1.attention.q_norm.weight"], torch.ones_like(st["layers.1.attention.q_norm.weight"]))  # trained
    out = export(ckpt, "hf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 257, (2, 64))
    with torch.no_grad():
        assert torch.allclose(model(ids), hf(ids).logits, atol=1e-4)
    first = {}
    for name, src in [("hf", out), ("st", tmp_path / "st" / "model.safetensors")]:
        again = tmp_path / f"from_{name}"
        proc = run_module(
            "core.train", "--config", str(cfg), f"--train.output_dir={again}", "--model.qk_norm=true", f"--checkpoint.initial_load={src}", "--train.steps=1"
        )
        assert proc.returncode == 0, proc.stderr
        first[name] = read_metrics(again)[0]["loss"]
    assert first["hf"] == pytest.approx(first["st"], abs=1e-6)


def test_run_starts_from_exported_weights(trained, tmp_path):
    """initial_load from the hf and the safetensors export give the same first loss (the DCP checkpoint
    as initial_load is covered by the sharded seed-checkpoint test below)."""
    cfg, ckpt = trained
    hf = export(ckpt, "hf", tmp_path / "hf")
    st = export(ckpt, "safetensors", tmp_path / "st")
    first = {}
    for name, src in [("hf", hf), ("st", st / "model.safetensors")]:
        out = tmp_path / f"run_{name}"
        proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}", f"--checkpoint.initial_load={src}", "--train.steps=1")
        assert proc.returncode == 0, proc.stderr
        assert "initial weights from" in proc.stdout
        first[name] = read_metrics(out)[0]["loss"]
    fresh = read_metrics(ckpt.parent.parent)[0]["loss"]  # the same config's first step from its own initial weights
    assert first["hf"] == pytest.approx(first["st"], abs=1e-6)
    assert abs(first["hf"] - fresh) > 1e-3  # the weights really came from the file


def test_seed_checkpoint_from_one_process_loads_into_sharded_run(trained, tmp_path):
    cfg, ckpt = trained
    proc = torchrun(
        2,
        "--config",
        str(cfg),
        f"--train.output_dir={tmp_path / 'sharded'}",
        f"--checkpoint.initial_load={ckpt}",
        "--parallelism.name=fsdp2",
        "--train.steps=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initial weights from" in proc.stdout


def test_bad_paths_exit_2(trained, tmp_path):
    cfg, _ = trained
    proc = run_module("core.export", "--checkpoint", str(tmp_path / "missing"), "--format", "hf", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    from core.cli.train import main

    code, _, err = main_here(main, "--config", str(cfg), f"--train.output_dir={tmp_path / 'r'}", f"--checkpoint.initial_load={tmp_path / 'nothing'}")
    assert code == 2 and "nothing not found" in err


def test_a_full_disk_is_one_line_exit_74_and_keeps_an_earlier_export_whole(trained, tmp_path):
    """``--out`` on a disk with room for one export and not two, holding an earlier export of the same
    files: the second export's write fails: one line and exit 74, nothing of it left, the earlier export
    as it was (never its ``config.json`` over the earlier one's); likewise ``core.report`` (never curves
    without ``manifest.json``)."""
    from conftest import PY, in_a_small_disk

    _, ckpt = trained
    disk = tmp_path / "disk"
    disk.mkdir()
    first = f'{PY} -m core.export --checkpoint "{ckpt}" --format hf --out "{disk}/e" > /dev/null && sha256sum "{disk}"/e/* > "{tmp_path}/before"'
    again = f'{PY} -m core.export --checkpoint "{ckpt}" --format hf --out "{disk}/e"; echo "export $?"; sha256sum "{disk}"/e/* > "{tmp_path}/after"'
    report = f'{PY} -m core.report --run "{ckpt.parent.parent}" --out "{disk}/r"; echo "report $?"; ls -A "{disk}"'
    done = in_a_small_disk("1400k", disk, f"{first} && {again}; {report}")
    if done is None:
        pytest.skip("this machine may not mount a tmpfs, even in a namespace of its own (unshare -m / -rm)")
    assert "export 74" in done.stdout and "report 74" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.stdout.split()[-1] == "e"  # no report folder, no staging folder left
    assert (tmp_path / "after").read_text() == (tmp_path / "before").read_text()  # the earlier export, whole
    errors = [line for line in done.stderr.splitlines() if line.startswith("plait:")]
    assert errors == [
        f"plait: error: cannot write {disk / 'e'} (ENOSPC: No space left on device; disk full, read-only or failing?): nothing was written there, what it held is unchanged",
        f"plait: error: cannot write {disk / 'r'} (ENOSPC: No space left on device; disk full, read-only or failing?): nothing was written there, what it held is unchanged",
    ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
