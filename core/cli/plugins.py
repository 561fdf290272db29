"""``python -m core.plugins``: every slot, its installed plugins and their options.

Also lists the core's own sections. ``--slot NAME`` limits the listing. ``--write-docs`` rewrites the
tables of README.md and docs/*.md generated from the declarations (:mod:`core.cli.doc_tables`).
"""

from __future__ import annotations

import sys

from core.cli import doc_tables
from core.contract.errors import ArgumentParser, PlaitError, exit_bad_input
from core.contract.options import describe
from core.contract.protocols import SLOT_DOCS, SLOTS


def _fmt(value) -> str:
    if value == "(required)":  # core.contract.options.describe's word for a field without a default: no value to quote
        return value
    return repr(value) if isinstance(value, str) else str(value)


def render_options(cls, indent: str) -> list[str]:
    rows = describe(cls)
    if not rows:
        return [f"{indent}(no options)"]
    width = max(len(r[0]) for r in rows)
    return [f"{indent}{name:<{width}}  {tp} = {_fmt(default)}  # {doc}" for name, tp, default, doc in rows]


def optional_line(comp, indent: str) -> list[str]:
    """Which optional members of its slot (core/contract/members.py) the component provides, read from an
    object its factory builds with the default options; said so when that cannot be built here."""
    from core.contract.members import CONTRACT, member, optional_provided

    if not any(not m.required for m in CONTRACT.get(comp.slot, [])):
        return []
    try:
        obj = comp.factory(comp.options())
    except Exception as e:  # a plugin whose defaults need a file, a library or a device
        if isinstance(comp.factory, type):  # a class: its methods and class attributes say it
            names = optional_provided(comp.slot, comp.factory)
            return [f"{indent}optional (from its class; default options: {type(e).__name__}): {', '.join(names) if names else 'none'}"]
        return [f"{indent}optional: not known until configured ({type(e).__name__} with the default options)"]
    names = optional_provided(comp.slot, obj)
    lines = [f"{indent}optional: {', '.join(names) if names else 'none'}"]
    architecture = member("model", obj, "architecture_options") if comp.slot == "model" else None
    if isinstance(architecture, tuple):
        lines.append(f"{indent}architecture (a resume from a checkpoint saved with other values is refused): {', '.join(map(str, architecture)) or 'none'}")
    return lines


def render(slot_filter: str | None = None) -> str:
    from core.config import registry as registry_mod
    from core.config.sections import CORE_SECTION_OPTIONS, DEFAULT_PLUGIN, PRECISION_CHAIN_DOC, SLOT_CORE_KEYS, SLOT_SECTIONS

    registry = registry_mod.load()
    lines: list[str] = []
    if slot_filter is None:
        lines.append("core sections")
        for section, cls in CORE_SECTION_OPTIONS.items():
            lines.append(f"  [{section}]")
            lines += render_options(cls, "      ")
        lines.append("")
    for slot in SLOTS:
        if slot_filter and slot != slot_filter:
            continue
        section = SLOT_SECTIONS.get(slot, "monitors.<name>")
        lines.append(f"{slot}: {SLOT_DOCS[slot]}  [{section}]")
        core_keys: dict = {}
        if slot in DEFAULT_PLUGIN:  # every slot section names its plugin; the monitors are listed in monitors.enabled
            default = DEFAULT_PLUGIN[slot]
            core_keys["name"] = ("str", "(required)" if default is None else default, f"the {slot} plugin below that fills this section")
        core_keys.update(SLOT_CORE_KEYS.get(slot, {}))
        if slot == "precision":
            core_keys.update(PRECISION_CHAIN_DOC)
        for key, (tp, default, doc) in core_keys.items():
            from core.contract.options import _type_name

            tname = tp if isinstance(tp, str) else _type_name(tp)
            lines.append(f"  (core key) {key}  {tname} = {_fmt(default)}  # {doc}")
        for comp in registry.components(slot):
            lines.append(f"  {comp.name}  -- {comp.doc}  [from {comp.distribution}, plugin {comp.plugin!r}]")
            lines += render_options(comp.options, "      ")
            lines += optional_line(comp, "      ")
        if not registry.names(slot):
            lines.append("  (none installed)")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m core.plugins", description=__doc__.split("\n\n")[0])
    parser.add_argument("--slot", choices=SLOTS, help="show one slot only")
    parser.add_argument("--contract", action="store_true", help="print what the core reads from each slot's object (core/contract/members.py)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the generated tables of README.md and docs/*.md (options, flags, contract)")
    args = parser.parse_args(argv)
    try:
        if args.write_docs:
            changed = doc_tables.write()
            print("\n".join(f"rewrote {p}" for p in changed) or "the generated tables are current")
            return 0
        if args.contract:
            from core.contract.members import describe_contract

            print(describe_contract())
            return 0
        print(render(args.slot))
    except PlaitError as e:
        exit_bad_input(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
