"""The docs agree with the code: the tables of options, flags, sections, modules and protocol members
that README.md and docs/*.md print are read here and held to what the code declares, so a renamed
option, a new flag, a new core section or a new required member cannot leave the docs behind.
Everything is read in this process (no run): a few seconds in all."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import pytest
from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    import tomli as tomllib

DOCS = REPO / "docs"


def text(name: str) -> str:
    return (REPO / name).read_text()


def table_rows(doc: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header row starts with ``header``."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def names_in(cell: str) -> list[str]:
    """The `code` spans of a cell, without flag metavars (``--nproc N`` -> ``--nproc``)."""
    return [c.split()[0] for c in re.findall(r"`([^`]+)`", cell)]


def toml_value(cell: str) -> Any:
    """A table cell as a TOML literal (``false``, ``"auto"``, ``[]``, ``0.01``), a `code` span as its
    text (```bytes```), else the cell itself (a description)."""
    try:
        return tomllib.loads(f"v = {cell.strip('`')}")["v"]
    except tomllib.TOMLDecodeError:
        return cell[1:-1] if re.fullmatch(r"`[^`<]+`", cell) else cell  # `<output_dir>/...`: a description


def defaults_of(cls: type) -> dict[str, Any]:
    from core.contract.options import describe

    return {name: default for name, _tp, default, _doc in describe(cls)}


def parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    """The argument parser a command's ``main()`` builds (caught at its ``parse_args``)."""

    class Caught(Exception):
        pass

    def catch(self, *args, **kwargs):
        raise Caught(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    with pytest.raises(Caught) as caught:
        main([])
    return caught.value.args[0]


def flags_of(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {a.option_strings[0]: a.default for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}


def test_configuration_md_names_every_core_section():
    from core.config.sections import CORE_SECTION_OPTIONS

    listed = {n for row in table_rows(text("docs/configuration.md"), "| section |") if row[1] == "core" for n in names_in(row[0])}
    assert listed == {f"[{s}]" for s in CORE_SECTION_OPTIONS}


def test_every_core_option_has_a_type_a_default_and_a_doc():
    """What ``python -m core.plugins`` prints for the core sections (the plugins' own: test_registry)."""
    from core.config.sections import CORE_SECTION_OPTIONS
    from core.contract.options import describe

    for section, cls in CORE_SECTION_OPTIONS.items():
        for name, tp, default, doc in describe(cls):
            assert tp and doc and "\n" not in doc and default != "(required)", (section, name)


def test_checkpoints_md_table_is_the_checkpoint_options():
    from core.config.sections import CheckpointOptions

    defaults, seen = defaults_of(CheckpointOptions), set()
    for row in table_rows(text("docs/checkpoints.md"), "| key | default |"):
        for key in names_in(row[0]):
            assert key in defaults, f"docs/checkpoints.md names [checkpoint].{key}, which is no option"
            seen.add(key)
            value = toml_value(row[1])
            if value != row[1]:  # a literal default (not a description such as <output_dir>/checkpoints)
                assert value == defaults[key], f"[checkpoint].{key}: docs say {row[1]}, the code {defaults[key]!r}"
    assert seen == set(defaults), f"missing from docs/checkpoints.md: {sorted(set(defaults) - seen)}"


def test_operations_md_recurrent_moe_table_is_the_monitor_options():
    from plugins.monitors.recurrent_moe import RecurrentMoEMonitorOptions

    defaults = defaults_of(RecurrentMoEMonitorOptions)
    for row in table_rows(text("docs/operations.md"), "| signal |"):
        for cell in row[1:]:
            key, default = re.match(r"`(\w+)` \(([^);]+)", cell).groups()  # type: ignore[union-attr]
            assert toml_value(default.split()[0]) == defaults[key], (key, default, defaults[key])


def test_the_plan_flag_table_lists_every_flag(monkeypatch):
    from core.cli.plan import main

    flags = flags_of(parser_of(main, monkeypatch))
    listed = {names_in(row[0])[0] for row in table_rows(text("docs/configuration.md"), "| flag | meaning |")}
    assert listed == set(flags) - {"--config"}
    for row in table_rows(text("docs/configuration.md"), "| flag | meaning |"):
        said = re.search(r"\(default (\d+)", row[1])
        if said:
            assert int(said.group(1)) == flags[names_in(row[0])[0]], row


def test_the_prepare_flag_table_is_the_command(monkeypatch):
    from plugins.data.prepare import main

    flags = flags_of(parser_of(main, monkeypatch))
    rows = table_rows(text("docs/data.md"), "| flag | default | what |")
    assert {names_in(row[0])[0] for row in rows} == set(flags)
    for row in rows:
        value = toml_value(row[1])
        if value != row[1]:  # a number or a `literal`, not a description
            assert value == flags[names_in(row[0])[0]], row


def test_writing_plugins_names_every_required_member_of_each_slot():
    """A required member the walk-through leaves out is a plugin written from it that is refused
    (the optimizer's ``options`` was)."""
    from core.contract.members import CONTRACT

    rows = {row[0]: row[1] for row in table_rows(text("docs/writing_plugins.md"), "| slot | the factory's result provides |")}
    for slot, members in CONTRACT.items():
        for m in members:
            if m.required:
                assert f"`{m.name}" in rows[slot], f"docs/writing_plugins.md: the {slot} row lacks {m.name}"


def test_writing_plugins_names_every_hook_and_every_end_reason():
    import core.contract.hookspecs as hookspecs

    doc = text("docs/writing_plugins.md")
    for hook in hookspecs.RUN_EVENT_HOOKS:
        assert f"`{hook}(" in doc, hook
    for reason in re.findall(r'\* ``"(\w+)"``', hookspecs.plait_train_end.__doc__ or ""):
        assert f"`{reason}`" in doc, reason


def test_the_members_of_prep_a_monitor_may_read_exist():
    import core.contract.hookspecs as hookspecs
    from core.preflight.prepare import Prepared

    doc = " ".join((hookspecs.plait_preflight.__doc__ or "").split())
    declared = re.findall(r"``(\w+)``", doc.split("may read its")[1].split("the rest is")[0])
    have = {f.name for f in dataclasses.fields(Prepared)} | {n for n, v in vars(Prepared).items() if isinstance(v, property)}
    assert len(declared) >= 6 and set(declared) <= have, set(declared) - have


def test_architecture_md_lists_every_module():
    doc = text("docs/architecture.md")
    for path in sorted((REPO / "core").rglob("*.py")):
        if path.stem != "__init__":
            assert re.search(rf"\b{path.stem}\.py\b", doc), f"docs/architecture.md does not list {path.relative_to(REPO)}"


def test_readme_lists_every_built_in_plugin():
    from core.config import registry as registry_mod
    from core.contract.protocols import SLOTS

    rows = {row[0]: row[1] for row in table_rows(text("README.md"), "| slot | plugins |")}
    reg = registry_mod.load()
    for slot in SLOTS:
        own = {c.name for c in reg.components(slot) if c.distribution == "plait"}
        listed = set(names_in(rows[slot])) & {n for s in SLOTS for n in reg.names(s)}  # flavors and flags aside
        assert own == listed, (slot, own ^ listed)


FILE_SUFFIXES = {"py", "md", "bin", "json", "safetensors"}  # train.bin, data.md, model.safetensors: files, not keys


def test_every_section_key_the_docs_name_is_an_option():
    """``train.steps``, ``checkpoint.keep_best``, ``data.path``, ``monitors.spikes.window``... anywhere in
    README.md and docs/*.md: each is an option of that core section, of some plugin of that slot, or of
    that monitor (the example plugin's components count: the docs walk through them)."""
    from core.config import registry as registry_mod
    from core.config.sections import CORE_SECTION_OPTIONS, PRECISION_CHAIN_DOC, SLOT_CORE_KEYS, SLOT_SECTIONS
    from core.contract.options import describe

    reg = registry_mod.load()
    keys = {section: {n for n, *_ in describe(cls)} for section, cls in CORE_SECTION_OPTIONS.items()}
    for slot, section in SLOT_SECTIONS.items():
        keys[section] = {"name", *SLOT_CORE_KEYS.get(slot, {}), *(PRECISION_CHAIN_DOC if slot == "precision" else {})}
        keys[section] |= {n for c in reg.components(slot) for n, *_ in describe(c.options)}
    keys["precision"] |= set(reg.names("precision"))  # [precision.fp8]: a fallback entry's own table
    monitors = {c.name: {n for n, *_ in describe(c.options)} for c in reg.components("monitor")}
    example = text("examples/plait-example-plugin/plait_example_plugin/__init__.py")
    monitors |= {name: None for name in re.findall(r'registry\.add\("monitor", "(\w+)"', example)}  # not installed here
    pattern = re.compile(rf"(?<![\w./(-])({'|'.join(keys)})\.([a-z_]\w*)(?:\.([a-z_]\w*))?(?![\w(])")
    bad = []
    for path in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                section, key, sub = m.groups()
                if key in FILE_SUFFIXES or key in keys[section]:
                    continue
                if section == "monitors" and key in monitors and (sub is None or monitors[key] is None or sub in monitors[key]):  # type: ignore[operator]
                    continue
                bad.append(f"{path.name}:{i}: {m.group(0)}")
    assert not bad, "the docs name options that do not exist:\n" + "\n".join(bad)


def test_every_file_and_test_the_docs_name_exists():
    """``core/checkpoint/staging.py``, ``tests/e2e/test_retention.py::test_...``, ``train_configs/1b_h100.toml``:
    each path under one of the repository's folders, and each test named, is there."""
    tops = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()} | {"train_configs", "launchers", "examples", "docs", "tests"}  # not runs/
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    bad = []
    for path in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        doc = path.read_text()
        for name in sorted(set(re.findall(r"\b[\w.-]+(?:/[\w.-]+)+\.(?:py|toml|sh|yaml|sbatch|md)\b", doc))):
            if name.split("/")[0] in tops and not (REPO / name).exists():
                bad.append(f"{path.name}: {name}")
        for test in sorted(set(re.findall(r"\btest_\w+", doc))):
            if not re.search(rf"def {test}\b", tests) and not any((REPO / "tests").rglob(f"{test}.py")):
                bad.append(f"{path.name}: {test}")
    assert not bad, "the docs name files or tests that do not exist:\n" + "\n".join(bad)


def test_configuration_md_lists_the_path_options():
    """The options resolved against their config file's folder (``option(..., path=True)``) are the ones
    configuration.md's "Paths" names."""
    from core.config import registry as registry_mod
    from core.config.sections import CORE_SECTION_OPTIONS, SLOT_SECTIONS
    from core.contract.protocols import SLOTS

    paths = {f"{s}.{f.name}" for s, cls in CORE_SECTION_OPTIONS.items() for f in dataclasses.fields(cls) if f.metadata.get("path")}
    for slot in SLOTS:
        for c in registry_mod.load().components(slot):
            section = SLOT_SECTIONS.get(slot, f"monitors.{c.name}")
            paths |= {f"{section}.{f.name}" for f in dataclasses.fields(c.options) if f.metadata.get("path")}
    doc = text("docs/configuration.md")
    listed = doc.split("*path options*")[1].split("A relative value")[0]
    assert set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", listed)) == paths


def test_configuration_md_states_each_slot_default_plugin():
    from core.config.sections import DEFAULT_PLUGIN

    sentence = text("docs/configuration.md").split("Defaults when a slot section is absent:")[1].split("\n\n")[0]
    said = dict(re.findall(r'`(\w+) = "(\w+)"`', sentence))
    assert said == {slot: name for slot, name in DEFAULT_PLUGIN.items() if name is not None}
    assert all(f"`[{slot}]`" in sentence for slot, name in DEFAULT_PLUGIN.items() if name is None)  # must name a plugin


@pytest.mark.parametrize("command, doc", [("core.cli.generate", "docs/generate.md"), ("core.cli.export", "docs/export.md"), ("core.cli.report", "README.md")])
def test_the_export_generate_and_report_docs_name_every_flag_and_its_default(command, doc, monkeypatch):
    """generate.md's usage line gives the defaults (`[--max-new-tokens 200]`): they are the command's,
    and `--help` says each one too (it said none of them)."""
    import importlib

    parser = parser_of(importlib.import_module(command).main, monkeypatch)
    flags, said = flags_of(parser), text(doc)
    assert [f for f in flags if f not in said] == []
    for flag, value in re.findall(r"\[(--[a-z-]+) ([0-9.]+)\]", said):
        assert float(value) == flags[flag], flag
    for action in parser._actions:
        if action.default not in (None, "", False, argparse.SUPPRESS) and action.option_strings[0] != "-h":
            assert "%(default)s" in (action.help or ""), action.option_strings


DOCS_BUDGET_BYTES = 113_000  # docs/ other than benchmarks.md: reference, not history (git log holds that)
RELIABILITY_BUDGET_BYTES = 20_000
LONGEST_LINE = 400


def test_the_docs_stay_within_their_size_and_line_limits():
    """Reference a newcomer can hold: docs/*.md but benchmarks.md at most 113,000 bytes together,
    docs/reliability.md under 20,000, and no line of the docs or README.md over 400 characters."""
    sizes = {p.name: len(p.read_bytes()) for p in DOCS.glob("*.md") if p.name != "benchmarks.md"}
    assert sum(sizes.values()) <= DOCS_BUDGET_BYTES, (
        f"docs/ without benchmarks.md is {sum(sizes.values())} bytes: {sorted(sizes.items(), key=lambda kv: -kv[1])}"
    )
    assert sizes["reliability.md"] < RELIABILITY_BUDGET_BYTES
    long = [
        f"{p.name}:{i}: {len(line)}"
        for p in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > LONGEST_LINE
    ]
    assert not long, f"lines over {LONGEST_LINE} characters:\n" + "\n".join(long)


def test_benchmarks_md_gives_each_latest_figure_its_command_device_date_and_versions():
    """Each measurement of docs/benchmarks.md is a ``###`` entry under an anchor, with the four facts."""
    doc = text("docs/benchmarks.md")
    entries = re.split(r'\n<a id="[\w-]+"></a>\n### ', doc)[1:]
    assert len(entries) >= 10 and len(entries) == doc.count("\n### ")
    for entry in entries:
        facts = re.findall(r"^- (command|device|date|versions): ", entry, re.M)
        assert facts == ["command", "device", "date", "versions"], entry[:200]
