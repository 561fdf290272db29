"""core.api is the one module plugins import from, it documents what it exports, and plugins say
things through its logger rather than print."""

from __future__ import annotations

import ast
import inspect
import re
import types
from pathlib import Path

import pytest
from conftest import REPO

import core.api as api
from core.contract.members import CONTRACT

EXAMPLE = REPO / "examples" / "plait-example-plugin" / "plait_example_plugin"
BUILTIN = [REPO / "plugins", REPO / "model_specs"]

# Built-in plugins that import a core internal, by (file, imported name), with the reason (none: the
# layers contract in pyproject.toml holds plugins/ and model_specs/ to core.api as well).
INTERNAL_IMPORTS: dict[tuple[str, str], str] = {}

# Files that print on purpose: the console monitor's step lines (no ``plait:`` prefix) and command-line tools.
PRINTS = {"plugins/monitors/console.py", "plugins/data/prepare.py", "plugins/data/corpus/build_shakespeare.py"}


def sources(*roots: Path) -> list[Path]:
    files = sorted(p for root in roots for p in root.rglob("*.py"))
    assert files, roots
    return files


# plait's internal packages: a plugin reaches them through core.api only.
INTERNAL_PACKAGES = ("core",)


def internal(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in INTERNAL_PACKAGES)


def core_imports(path: Path) -> list[str]:
    """Every name a file imports from plait's own packages (``core``), as
    ``package.module.name`` (``package.module`` for a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if internal(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and internal(node.module):
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def documented(obj) -> bool:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    # a dataclass without a docstring gets its signature as __doc__
    return bool(doc and doc.strip()) and not doc.startswith(f"{getattr(obj, '__name__', '')}(")


def test_every_export_resolves_and_is_documented():
    assert len(api.__all__) == len(set(api.__all__))
    for name in api.__all__:  # the exports whose modules import torch are imported on first use
        getattr(api, name)
    public = {n for n in vars(api) if not n.startswith("_") and n != "annotations"}
    assert public == set(api.__all__), "core.api defines or imports a name outside __all__ (or lists one it lacks)"
    for name in api.__all__:
        obj = getattr(api, name)
        if isinstance(obj, (type, types.FunctionType, types.ModuleType)):
            assert documented(obj), f"core.api.{name} has no docstring"
    for name, fn in vars(api.log).items():
        if isinstance(fn, types.FunctionType) and not name.startswith("_"):
            assert documented(fn), f"core.api.log.{name} has no docstring"
    assert set(api.SLOT_PROTOCOLS) == set(api.SLOTS)


def test_the_exports_are_the_type_checking_import_lines_and_load_on_first_use():
    """core.api names each export once, in an import line under TYPE_CHECKING: ``__all__``, the lazy
    imports and the docstring's index all come from those lines; importing core.api imports no torch."""
    import subprocess
    import sys

    tree = ast.parse((REPO / "core" / "api.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    lines = {a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert list(lines) == api.__all__ and len(lines) > 50
    assert all(f"``{name}``: ``{module}``" in (api.__doc__ or "") for name, module in lines.items())
    probe = "import sys, core.api; assert 'torch' not in sys.modules; core.api.IndexedSource; assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", probe], cwd=REPO).returncode == 0


@pytest.mark.parametrize("cls", ["Run", "PreparedRun", "DistInfo", "LoaderSpec"])
def test_what_a_monitor_is_handed_documents_every_field(cls):
    """``help(core.api.Run)`` (and the other run types) names every field: a third party reads there
    what each one holds, never the declaration."""
    import dataclasses

    obj = getattr(api, cls)
    doc = " ".join((obj.__doc__ or "").split())
    missing = [f.name for f in dataclasses.fields(obj) if f"``{f.name}``" not in doc]
    assert not missing, f"core.api.{cls}'s docstring does not name {missing}"


def test_the_example_plugin_imports_only_core_api():
    seen = []
    for path in sources(EXAMPLE):
        for name in core_imports(path):
            assert name.startswith("core.api."), f"{path.relative_to(REPO)} imports {name}: a third-party plugin imports only core.api"
            assert name.removeprefix("core.api.") in api.__all__, f"{path.relative_to(REPO)}: {name} is not in core.api.__all__"
            seen.append(name)
    assert "core.api.hookimpl" in seen


def test_builtin_plugins_import_core_internals_only_where_listed():
    internal = {}
    for path in sources(*BUILTIN):
        rel = path.relative_to(REPO).as_posix()
        for name in core_imports(path):
            if name.startswith("core.api."):
                assert name.removeprefix("core.api.") in api.__all__, f"{rel}: {name} is not in core.api.__all__"
            else:
                internal[(rel, name)] = name
    unexpected = sorted(set(internal) - set(INTERNAL_IMPORTS))
    assert not unexpected, f"import these from core.api (or list them, with the reason, in INTERNAL_IMPORTS): {unexpected}"
    stale = sorted(set(INTERNAL_IMPORTS) - set(internal))
    assert not stale, f"INTERNAL_IMPORTS lists imports that are gone: {stale}"
    assert all(INTERNAL_IMPORTS.values()), "every exception says why"


def protocol_members(proto: type) -> set[str]:
    names = set(proto.__dict__.get("__annotations__", {}))
    names |= {n for n, v in proto.__dict__.items() if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}
    return names


@pytest.mark.parametrize("slot", list(CONTRACT))
def test_the_contract_is_declared_by_the_slot_protocol(slot):
    """A required member is declared on the protocol core.api exports, with the contract's number of
    arguments; an optional one is named in the protocol's docstring, and the contract says what the
    core does without it. Nothing the protocol declares is missing from the contract."""
    proto = api.SLOT_PROTOCOLS[slot]
    members = protocol_members(proto)
    for m in CONTRACT[slot]:
        if not m.required:
            assert re.search(rf"\b{m.name}\b", proto.__doc__ or ""), f"{proto.__name__}'s docstring does not name the optional {m.name}"
            assert "default" in m.doc, f"the contract does not say what the core does without {slot}.{m.name}"
            continue
        assert m.name in members, f"{proto.__name__} does not declare the required {m.name}"
        if m.kind == "method":
            params = [p for p in inspect.signature(getattr(proto, m.name)).parameters.values() if p.name != "self"]
            assert len(params) == m.params, f"{proto.__name__}.{m.name} takes {len(params)} argument(s), the contract {m.params}"
    assert members <= {m.name for m in CONTRACT[slot] if m.required}, f"{proto.__name__} declares members the contract lacks"


# -- one logger ------------------------------------------------------------------------------


def test_plugins_and_model_specs_do_not_print():
    printing = set()
    for path in sources(*BUILTIN, EXAMPLE):
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "print") or (
                isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute) and f.value.attr in ("stdout", "stderr")
            ):
                printing.add(rel)
                assert rel in PRINTS, f"{rel}:{node.lineno} prints: use core.api.log (info, note, warn, error)"
    assert printing == PRINTS, f"PRINTS lists files that no longer print: {sorted(PRINTS - printing)}"


def test_plugins_do_not_read_the_rank_from_the_environment():
    """Whether to speak is the logger's decision; a plugin that needs its rank has DistInfo."""
    for path in sources(*BUILTIN, EXAMPLE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            assert not (isinstance(node, ast.Constant) and node.value in ("RANK", "LOCAL_RANK")), f"{path.relative_to(REPO)}:{node.lineno}"


def spike(monitor):
    from core.contract.protocols import DistInfo
    from core.contract.run import Run

    run = Run(config={}, output_dir=Path("."), dist=DistInfo(), total_steps=100, tokens_per_step=1)
    for step in range(1, 12):
        monitor.plait_before_update(run=run, step=step, loss=3.0 + 0.01 * (step % 2), grad_norm=1.0)
    return monitor.plait_before_update(run=run, step=12, loss=30.0, grad_norm=1.0)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_monitor_warning_is_printed_by_rank_zero_only(monkeypatch, capsys, rank):
    from plugins.monitors.spikes import Spikes, SpikesOptions

    monkeypatch.setenv("RANK", rank)
    assert spike(Spikes(SpikesOptions(action="log"))) is None
    err = capsys.readouterr().err
    assert ("plait: spikes: step 12: spike in loss 30" in err) == (rank == "0"), err


def test_a_shard_speaks_for_itself_on_every_rank(monkeypatch, capsys, tmp_path):
    import json

    from core.contract.protocols import LoaderSpec
    from plugins.data.text_stream import TextStream, TextStreamOptions

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(8)))
    monkeypatch.setenv("RANK", "1")
    s = TextStream(TextStreamOptions(files=[str(corpus)], on_end="stop"))
    s.validate(512, 32)
    assert list(s.loader(LoaderSpec(32, 2, 1, 1, 2, 42)))
    assert 'plait: text_stream shard 1: end of the files (on_end = "stop")' in capsys.readouterr().err
