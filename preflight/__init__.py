"""From a config file to checked, instantiated components, before any process group or model.

:mod:`.config` reads TOML files (``extends``, ``--section.key=value`` overrides),
:mod:`.run_config` gives the core's sections and one section per slot their meaning,
:mod:`.option_values` checks each table against its options dataclass, and :mod:`.prepare`
loads the plugins, instantiates and checks every component and the data, and finds the
checkpoint to resume from. ``python -m core.train`` and ``python -m core.plan`` run the same checks.
"""
