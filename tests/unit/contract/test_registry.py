"""Plugin discovery through real entry points, duplicate names, import failures."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from core.config import registry as registry_mod
from core.contract.errors import ConfigError, PluginError
from core.contract.options import option
from core.contract.protocols import SLOTS


def test_builtins_come_through_entry_points():
    reg = registry_mod.load()
    for slot, name in [
        ("model", "llama3"),
        ("parallelism", "ddp"),
        ("parallelism", "single"),
        ("precision", "bf16"),
        ("data", "token_bin"),
        ("optimizer", "adamw"),
        ("lr_schedule", "warmup_cosine"),
        ("monitor", "jsonl"),
    ]:
        comp = reg.get(slot, name, "test")
        assert comp.distribution == "plait", comp
    assert set(SLOTS) == {"model", "parallelism", "precision", "data", "optimizer", "lr_schedule", "monitor"}


def test_unknown_name_lists_installed_and_closest():
    reg = registry_mod.load()
    with pytest.raises(ConfigError, match=r"no optimizer plugin named 'adamww' \(did you mean 'adamw'\?\); installed: .*adamw"):
        reg.get("optimizer", "adamww", "run.toml: [optimizer]")


@dataclass
class O:
    x: int = option(1, "x")


def test_duplicate_name_names_both_providers():
    reg = registry_mod.Registry()
    reg._plugin, reg._distribution = "first", "dist-one"
    reg.add("monitor", "m", object, options=O, doc="d")
    reg._plugin, reg._distribution = "second", "dist-two"
    with pytest.raises(
        PluginError, match=r"monitor 'm' is claimed twice: by plugin 'first' \(distribution dist-one\) and by plugin 'second' \(distribution dist-two\)"
    ):
        reg.add("monitor", "m", object, options=O, doc="d")


def test_undocumented_option_and_bad_slot_rejected():
    @dataclass
    class Bare:
        y: int = 3

    reg = registry_mod.Registry()
    with pytest.raises(PluginError, match="lack a doc: y"):
        reg.add("monitor", "b", object, options=Bare)
    with pytest.raises(PluginError, match="unknown slot 'monitors'"):
        reg.add("monitors", "b", object, options=O)


def test_every_builtin_option_is_documented():
    reg = registry_mod.load()
    from core.contract.options import describe

    for slot in SLOTS:
        for comp in reg.components(slot):
            assert comp.doc and "\n" not in comp.doc, (slot, comp.name)  # the line core.plugins prints beside the name
            for name, tp, default, doc in describe(comp.options):
                assert doc and tp and "\n" not in doc, (slot, comp.name, name)


def test_loading_the_plugins_imports_no_dtensor():
    """Reading the installed plugins (every command does, ``core.plan`` included) leaves
    ``torch.distributed.tensor`` unloaded: it costs a fresh process about a CPU-second, and only a
    sharded run needs it (``bench/command_cost.py`` measures a fresh ``core.plan``)."""
    import subprocess
    import sys

    from conftest import REPO, env

    code = "import sys; from core.config import registry; registry.load(); print('torch.distributed.tensor' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr[-2000:])


def test_each_plugin_distributions_metadata_is_read_once(monkeypatch):
    """Every command loads the plugins; a distribution's name comes from parsing its METADATA file,
    so plait reads each distribution's once (importlib's own listing of the entry points may read it
    once more), never once per entry point."""
    from collections import Counter
    from importlib import metadata

    reads: Counter[str] = Counter()
    real = metadata.PathDistribution.read_text

    def counting(self, filename):  # type: ignore[no-untyped-def]
        if filename in ("METADATA", "PKG-INFO"):
            reads[str(self._path)] += 1
        return real(self, filename)

    monkeypatch.setattr(metadata.PathDistribution, "read_text", counting)
    registry_mod._load(None)  # what registry.load() does once per process
    assert reads and max(reads.values()) <= 2, reads  # plait's own distribution has 8 entry points


def installed(site, monkeypatch, code: str, package: str = "guessing_plugin") -> None:
    """A distribution on ``sys.path`` whose entry point ``guessing`` in group ``plait`` is ``package``."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(code)
    dist = site / f"{package}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[plait]\nguessing = {package}\n")
    monkeypatch.syspath_prepend(str(site))


@pytest.mark.parametrize(
    "code, words",
    [
        (  # a name the module never had, from an internal module that exists
            "from core.api import hookimpl\nfrom core.contract.options import (\n    NoOptions,\n    Registry,\n)\n",
            "ImportError: cannot import name 'Registry' from 'core.contract.options' (",
        ),
        (  # an internal module path that does not exist (moved, or guessed)
            "from core.data.text_tokenizers import Tokenizer as T\n",
            "ModuleNotFoundError: No module named 'core.data.text_tokenizers'",
        ),
        ("import core.loop.evaluations\n", "ModuleNotFoundError: No module named 'core.loop.evaluations'"),
        ("from core.loop.nothere import make_it_fast\n", "ModuleNotFoundError: No module named 'core.loop.nothere'"),
        ("import numpyy\n", "ModuleNotFoundError: No module named 'numpyy'"),
    ],
)
def test_a_plugin_importing_an_internal_path_is_told_the_core_api_name(tmp_path, monkeypatch, code, words):
    """A third-party plugin that fails to import from a ``core`` module path other than ``core.api`` gets
    one line naming the plugin and the ``core.api`` import to write instead (a pointer to ``core.api``
    when it exports no such name); any other import failure gets no such hint."""
    installed(tmp_path / "site", monkeypatch, code)
    with pytest.raises(PluginError) as e:
        registry_mod._load(None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"plugin 'guessing' (distribution guessing-plugin, guessing_plugin) failed to import: {words}"), msg
    hint = {
        "Registry": "; plugins import from core.api alone: from core.api import NoOptions, Registry;",
        "text_tokenizers": "; plugins import from core.api alone: from core.api import Tokenizer;",
        "evaluations": "; plugins import from core.api alone (help(core.api) lists its names);",
        "nothere": "; plugins import from core.api alone (help(core.api) lists its names);",
        "numpyy": "'numpyy'; to run without it",
    }
    assert next(h for key, h in hint.items() if key in code) in msg, msg
