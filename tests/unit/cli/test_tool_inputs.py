"""Bad input to the tools (prepare, export, report, plan): one ``plait: error:`` line naming the flag,
key or file, exit code 2, no traceback. Each command's ``main`` runs in this process (``conftest.run_here``):
what is tested is its decision, made before it builds anything."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from conftest import run_here, write_tiny_config
from shared import one_document, one_line_error


@pytest.fixture
def corpus(tmp_path) -> Path:
    return one_document(tmp_path)


def prepare(corpus: Path, out: Path, *args: str):
    return run_here("plugins.data.prepare", "--input", str(corpus), "--out", str(out), "--workers", "1", *args)


def hf_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["hello world"] * 4, trainers.BpeTrainer(vocab_size=270, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet))
    tok.save(str(path))
    return path


# --- tokenizer specs and --eos-id -------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, make, expected",
    [
        ("hf:{d}/tok.json", lambda d: (d / "tok.json").write_text("not json"), "not a tokenizers JSON file"),
        ("tiktoken:{d}/r.tiktoken", lambda d: (d / "r.tiktoken").write_text("garbage!!! x\n"), "not a tiktoken ranks file"),
        ("sentencepiece", lambda d: None, "expected bytes, hf:PATH"),
    ],
)
def test_prepare_bad_tokenizer(tmp_path, corpus, spec, make, expected):
    make(tmp_path)
    spec = spec.format(d=tmp_path)
    one_line_error(prepare(corpus, tmp_path / "out", "--tokenizer", spec), "--tokenizer", spec, expected)
    assert not (tmp_path / "out").exists()


def test_unknown_tokenizer_kind_in_the_data_section(tmp_path, corpus):
    text = write_tiny_config(tmp_path).read_text()
    data = text[text.index("[data]") : text.index("[precision]")]
    cfg = tmp_path / "stream.toml"
    cfg.write_text(text.replace(data, f'[data]\nname = "text_stream"\nfiles = ["{corpus}"]\ntokenizer = "sentencepiece"\nseq_len = 128\n'))
    proc = run_here("core.plan", "--config", str(cfg))
    line = one_line_error(proc, "tokenizer 'sentencepiece'", "expected bytes, hf:PATH")
    assert "not found" not in line


def test_a_relative_tokenizer_path_that_is_missing_says_where_it_looked(tmp_path, corpus):
    """text_stream's tokenizer path is relative to the working directory, unlike its files (relative to
    the config): the error said only 'tok.json not found'."""
    text = write_tiny_config(tmp_path).read_text()
    data = text[text.index("[data]") : text.index("[precision]")]
    cfg = tmp_path / "stream.toml"
    cfg.write_text(text.replace(data, f'[data]\nname = "text_stream"\nfiles = ["{corpus}"]\ntokenizer = "hf:tok.json"\nseq_len = 128\n'))
    (tmp_path / "tok.json").write_text("{}")  # beside the config, where the user expected it to be read from
    work = tmp_path / "work"
    work.mkdir()
    one_line_error(run_here("core.plan", "--config", str(cfg), cwd=work), f"tok.json not found (a relative path is taken from the working directory, {work})")


@pytest.mark.parametrize("tokenizer, eos", [("bytes", "300"), ("bytes", "-5"), ("hf", "-5"), ("hf", "270"), ("tiktoken", "-5"), ("tiktoken", "65")])
def test_prepare_refuses_an_eos_id_the_tokenizer_cannot_use(tmp_path, corpus, tokenizer, eos):
    if tokenizer == "hf":
        pytest.importorskip("tokenizers")
        tokenizer = f"hf:{hf_tokenizer(tmp_path / 'tokenizer.json')}"
    elif tokenizer == "tiktoken":
        ranks = tmp_path / "bytes.tiktoken"
        ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
        tokenizer = f"tiktoken:{ranks}"
    one_line_error(prepare(corpus, tmp_path / "out", "--tokenizer", tokenizer, "--eos-id", eos), f"--eos-id {eos}")
    assert not (tmp_path / "out").exists()


def test_export_eos_id_without_tokenizer_is_refused(tmp_path, capsys):
    """--eos-id belongs to --tokenizer (as in core.generate); alone, core.export ignored it without a word."""
    from core.cli.export import main

    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(tmp_path / "missing"), "--format", "hf", "--out", str(tmp_path / "hf"), "--eos-id", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--eos-id: 5 is the EOS of --tokenizer, and no --tokenizer is given" in err, err


# --- plan --plot-lr -----------------------------------------------------------------------------


@pytest.mark.parametrize("path, expected", [("/proc/plait-test/lr.png", "writable folder"), ("{d}/lr.txt", "expected a file name ending in")])
def test_plan_plot_lr_path_checked_first(tmp_path, path, expected):
    path = path.format(d=tmp_path)
    proc = run_here("core.plan", "--config", str(write_tiny_config(tmp_path)), "--config-only", "--plot-lr", path)
    one_line_error(proc, "--plot-lr", expected)
    assert proc.stdout == ""  # refused before the plan is made


# --- optional libraries that are not installed (the quick start installs plait without extras) ------


@pytest.mark.parametrize(
    "module, command, args, expected",
    [
        (
            "tokenizers",
            "plugins.data.prepare",
            ["--tokenizer", "hf:{d}/tok.json"],
            "--tokenizer 'hf:{d}/tok.json' needs the tokenizers library (pip install 'plait[data]')",
        ),
        ("tiktoken", "plugins.data.prepare", ["--tokenizer", "tiktoken:{d}/tok.json"], "needs the tiktoken library (pip install 'plait[data]')"),
        (
            "matplotlib",
            "core.cli.report",
            ["--run", "{d}", "--out", "{d}/report"],
            "core.report draws its curves with matplotlib (pip install 'plait[report]')",
        ),
    ],
)
def test_a_missing_optional_library_is_one_line(tmp_path, corpus, monkeypatch, capsys, module, command, args, expected):
    """A command whose optional library is missing says so in one line before it writes anything."""
    import importlib
    import sys

    (tmp_path / "tok.json").write_text("{}")
    monkeypatch.setitem(sys.modules, module, None)  # what an install without the extra gives: the import fails
    args = [a.format(d=tmp_path) for a in args]
    if command == "plugins.data.prepare":
        args += ["--input", str(corpus), "--out", str(tmp_path / "out"), "--workers", "1"]
    with pytest.raises(SystemExit) as e:
        importlib.import_module(command).main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and expected.format(d=tmp_path) in err[0], err
    assert not (tmp_path / "report").exists() and not (tmp_path / "out").exists()
