"""A third-party plugin's own faults, each reported in one line that names the plugin (exit 2)
before anything is built: a hook of the wrong shape, a hook without its marker, a name that is not a
string, options whose annotations or defaults are broken, and plugin code that raises or returns
the wrong thing during the checks before a run: never a traceback, never a silent pass.
Real entry points (a distribution on PYTHONPATH), real ``core.plan`` processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_module, write_tiny_config

HEAD = "from __future__ import annotations\nimport contextlib\nfrom dataclasses import dataclass\nfrom core.api import hookimpl, option\n"
SCHEDULE = "class Sched:\n    def __init__(self, options):\n        pass\n    def multiplier(self, step, total):\n        return 1.0\n"

CASES = {
    "hook_signature": (
        "@hookimpl\ndef plait_register(registry, extra):\n    pass\n",
        [],
        "plugin 'evil'",
    ),
    "hook_unmarked": (
        "def plait_register(registry):\n    pass\n",
        [],
        "defines plait_register without the @hookimpl marker",
    ),
    "name_not_a_string": (
        SCHEDULE + "@hookimpl\ndef plait_register(registry):\n    registry.add('lr_schedule', 5, Sched, doc='d')\n",
        [],
        "registers a lr_schedule component named 5: expected a non-empty string",
    ),
    "annotation_unresolved": (
        SCHEDULE + "@dataclass\nclass O:\n    x: Missing = option(1, 'x')\n"
        "@hookimpl\ndef plait_register(registry):\n    registry.add('lr_schedule', 'evil', Sched, options=O, doc='d')\n",
        [],
        "its type annotations do not resolve (NameError",
    ),
    "default_out_of_bounds": (
        SCHEDULE + "@dataclass\nclass O:\n    x: int = option(-5, 'x', ge=0)\n"
        "@hookimpl\ndef plait_register(registry):\n    registry.add('lr_schedule', 'evil', Sched, options=O, doc='d')\n",
        [],
        "options of lr_schedule 'evil': the default of x: must be >= 0, got -5",
    ),
    "factory_raises": (
        "class Sched:\n    def __init__(self, options):\n        raise RuntimeError('boom in factory')\n"
        "@hookimpl\ndef plait_register(registry):\n    registry.add('lr_schedule', 'evil', Sched, doc='d')\n",
        ["--lr_schedule.name=evil"],
        "lr_schedule 'evil' from plugin 'evil' (distribution evil-plait-plugin) failed: RuntimeError: boom in factory",
    ),
    "multiplier_returns_none": (
        SCHEDULE.replace("return 1.0", "return None") + "@hookimpl\ndef plait_register(registry):\n    registry.add('lr_schedule', 'evil', Sched, doc='d')\n",
        ["--lr_schedule.name=evil"],
        "'evil': multiplier(0, 4) returned None; expected a finite number >= 0",
    ),
    "supported_returns_a_bool": (
        "class P:\n    name = 'evil'\n    param_dtype = None\n    def __init__(self, options):\n        pass\n"
        "    def supported(self, device):\n        return True\n    def convert(self, model, spec):\n        return model\n"
        "    def autocast(self, device):\n        return contextlib.nullcontext()\n    def metrics(self, model):\n        return {}\n"
        "@hookimpl\ndef plait_register(registry):\n    registry.add('precision', 'evil', P, doc='d')\n",
        ["--precision.name=evil"],
        "precision 'evil': supported('cpu') returned True; expected (ok: bool, reason: str)",
    ),
    "monitor_preflight_raises": (
        "class M:\n    def __init__(self, options):\n        pass\n    @hookimpl\n    def plait_preflight(self, prep):\n        raise RuntimeError('boom in preflight')\n"
        "@hookimpl\ndef plait_register(registry):\n    registry.add('monitor', 'evil', M, doc='d')\n",
        ['--monitors.enabled=["console", "evil"]'],
        "monitor 'evil': plait_preflight failed: RuntimeError: boom in preflight",
    ),
    "name_of_a_builtin": (  # named the third-party plugin as the first claimant: plugins registered in reverse order
        SCHEDULE + "@hookimpl\ndef plait_register(registry):\n    registry.add('lr_schedule', 'constant', Sched, doc='d')\n",
        [],
        "lr_schedule 'constant' is claimed twice: by plugin 'schedules' (distribution plait) and by plugin 'evil' (distribution evil-plait-plugin)",
    ),
    "data_validate_raises": (  # was a RuntimeError traceback (exit 1) from preflight
        "from core.api import IndexedSource\n"
        "class D(IndexedSource):\n    def __init__(self, options):\n        pass\n    def validate(self, vocab_size, seq_len):\n        raise RuntimeError('boom in validate')\n"
        "@hookimpl\ndef plait_register(registry):\n    registry.add('data', 'evil', D, doc='d')\n",
        ["--data.name=evil"],
        "data 'evil': validate failed: RuntimeError: boom in validate",
    ),
    "data_ids_beyond_the_vocabulary": (  # was an IndexError traceback from the embedding, mid-run
        "import numpy as np\nfrom core.api import IndexedSource\n"
        "class D(IndexedSource):\n    def __init__(self, options):\n        pass\n    def validate(self, vocab_size, seq_len):\n        pass\n"
        "    def sample(self, index, seq_len, split):\n        return np.arange(seq_len + 1) + 1000\n"
        "@hookimpl\ndef plait_register(registry):\n    registry.add('data', 'evil', D, doc='d')\n",
        ["--data.name=evil"],
        "data 'evil': sample(0, seq_len=128, 'train') returned token ids from 1000 to 1128; expected ids in 0..511 (the model's vocabulary)",
    ),
}


def install(site: Path, code: str) -> dict[str, str]:
    """A distribution ``evil-plait-plugin`` with entry point ``evil`` in group ``plait``, importable from ``site``."""
    (site / "evil_plait_plugin").mkdir(parents=True)
    (site / "evil_plait_plugin" / "__init__.py").write_text(HEAD + code)
    dist = site / "evil_plait_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil-plait-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[plait]\nevil = evil_plait_plugin\n")
    return {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_faulty_plugin_is_one_line_naming_it(tmp_path, case):
    code, args, expected = CASES[case]
    env = install(tmp_path / "site", code)
    proc = run_module("core.plan", "--config", str(write_tiny_config(tmp_path, steps=4)), *args, extra_env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("plait: error: ") and expected in lines[0], proc.stderr[-3000:]


def test_a_precision_whose_metrics_are_not_a_dict_is_one_line_naming_it_mid_run(tmp_path):
    """The precision's ``metrics(model)`` is asked at log steps only; a list there is one line naming
    the plugin, not a TypeError from the core's metrics merge after the first step."""
    code = CASES["supported_returns_a_bool"][0].replace("return True", "return True, ''").replace("return {}", "return [('amax', 1.0)]")
    env = install(tmp_path / "site", code)
    proc = run_module("core.train", "--config", str(write_tiny_config(tmp_path, steps=2)), "--precision.name=evil", extra_env=env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("plait: error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines == ["plait: error: precision 'evil': metrics() returned [('amax', 1.0)]; expected a dict of metric names to numbers (or lists of numbers)"], (
        proc.stderr[-3000:]
    )
