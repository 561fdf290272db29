"""The package layout: the library under ``core/`` never imports ``core/cli/`` (the commands); the
commands the README documents as ``python -m core.<command>`` run through a hand-off in ``core/`` that
holds nothing but that hand-off."""

from __future__ import annotations

import ast
import re

import pytest
from conftest import REPO, run_here

CORE = REPO / "core"
# The library: what a run imports. core/cli/ (the commands) imports it, never the other way round.
LIBRARY = [CORE]
# python -m core.<name> for each command: it lives in core/cli/<name>.py
SHIMS = ("train", "plan", "plugins", "export", "report", "generate", "eval")


def is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``"""
    if not isinstance(node, ast.If) or node.orelse or not isinstance(node.test, ast.Compare):
        return False
    t = node.test
    return (
        isinstance(t.left, ast.Name)
        and t.left.id == "__name__"
        and len(t.ops) == 1
        and isinstance(t.ops[0], ast.Eq)
        and isinstance(t.comparators[0], ast.Constant)
        and t.comparators[0].value == "__main__"
    )


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module a file imports: import statements, ``__import__`` and ``importlib.import_module`` with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("__import__", "import_module"):
                out.append((node.lineno, node.args[0].value))
    return out


def is_tools(module: str) -> bool:
    return module == "core.cli" or module.startswith("core.cli.")


def test_the_library_never_imports_tools():
    """Only the command hand-offs name tools, and only when run as ``python -m`` (a guarded import)."""
    files = sorted(p for root in LIBRARY for p in root.rglob("*.py") if "cli" not in p.relative_to(CORE).parts)
    assert len(files) > 35
    bad = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        allowed: set[int] = set()
        if path.parent == CORE and path.stem in SHIMS:
            guard = tree.body[-1]
            assert is_main_guard(guard), f"{path.name}: ends in if __name__ == '__main__'"
            allowed = {n.lineno for n in ast.walk(guard) if isinstance(n, ast.ImportFrom)}
        bad += [f"{path.relative_to(REPO)}:{line}: imports {m}" for line, m in imported_names(tree) if is_tools(m) and line not in allowed]
    assert not bad, "the library imports tools:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", SHIMS)
def test_a_shim_holds_only_the_hand_off(name):
    path = CORE / f"{name}.py"
    text = path.read_text()
    assert len(text.splitlines()) < 15, f"core/{name}.py: more than a hand-off"
    tree = ast.parse(text)
    doc, guard = tree.body  # a docstring and the __main__ guard, nothing else: no names to import from core.<name>
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and f"core.cli.{name}" in doc.value.value
    assert is_main_guard(guard)
    imp, call = guard.body
    # train leaves through run_and_exit (no interpreter finalization after a run: core/cli/train.py)
    entry, ending = ("run_and_exit", "run_and_exit()") if name == "train" else ("main", "raise SystemExit(main())")
    assert isinstance(imp, ast.ImportFrom) and imp.module == f"core.cli.{name}" and [a.name for a in imp.names] == [entry]
    assert ast.unparse(call) == ending
    assert (CORE / "cli" / f"{name}.py").is_file()


def documented_commands() -> list[str]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {m for p in docs for m in re.findall(r"python3? -m core\.(\w+)\b(?!\.)", p.read_text())}
    return sorted(found)


def test_the_documented_commands_are_the_known_ones():
    assert set(SHIMS) == set(documented_commands())
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    modules = {m for p in docs for m in re.findall(r"python3? -m core\.cli\.(\w+)", p.read_text())}  # commands without a hand-off
    assert all((CORE / "cli" / f"{m}.py").is_file() for m in modules), modules


def documented_flags(name: str) -> dict[str, str]:
    """Each ``--flag`` the docs write after ``python -m core.<name>`` (on its line, and the lines a
    trailing backslash continues), up to the next command: ``{flag: where}``. ``--section.key``
    overrides are the config's, not flags."""
    found: dict[str, str] = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            for m in re.finditer(rf"-m core\.{name}\b", line):
                rest, j = line[m.end() :], i
                while rest.rstrip().endswith("\\") and j + 1 < len(lines):
                    j += 1
                    rest = rest.rstrip()[:-1] + " " + lines[j]
                rest = re.split(r"core\.\w+|torchrun|plugins\.data", rest)[0]
                for flag in re.findall(r"(?<![\w.-])(--[a-z][a-z0-9-]*)(?![\w.])", rest):
                    found.setdefault(flag, f"{path.name}:{i + 1}")
    return found


@pytest.mark.parametrize("name", documented_commands())
def test_documented_command_help(name):
    """Every command the docs name has a --help, and every flag they give it is one of its own (its
    ``main`` in this process; ``python -m core.<name>`` itself runs in the other tests' processes)."""
    proc = run_here(f"core.{name}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m core.{name}"), proc.stdout[:200]
    unknown = {flag: where for flag, where in documented_flags(name).items() if not re.search(rf"{flag}\b", proc.stdout)}
    assert not unknown, f"the docs give python -m core.{name} flags it does not have: {unknown}"


def test_the_readme_test_command_is_what_ci_runs():
    readme = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("python3 -m venv") and "pytest" in line]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(readme) == 1 and len(ci) == 1, (readme, ci)
    assert ci[0].replace("pip install -q ", "pip install ") == readme[0]
    assert "&& .venv/bin/lint-imports &&" in readme[0]
