"""plait core: the plugin contract and the machinery that trains with plugins.

The core knows no concrete plugin: everything it trains with is found through the
``plait`` entry-point group. Its packages, bottom to top (imports run one way, upward
never; ``pyproject.toml``'s ``[tool.importlinter]`` states the layers, and ``lint-imports`` checks
them in CI and in ``tests/unit/project/test_layout.py``):

- :mod:`core.contract`: each slot's protocol and members, hooks, options and their checking, errors, logger
- :mod:`core.config`: TOML files, extends, overrides, the core's own sections, the plugin registry and slot resolution
- :mod:`core.runtime`: process group, run-folder lock, durable writes, stop signals, watchdog
- :mod:`core.data`: the index-addressed loader and its read-ahead
- :mod:`core.checkpoint`: the Checkpointer and what a checkpoint holds
- :mod:`core.preflight`: the config resolved into checked components before any process group
- :mod:`core.loop`: the trainer and its step
- :mod:`core.cli`: the commands (``python -m core.<command>`` hands off to them)

:mod:`core.api` is the one module plugins import; it sits on top with the ``python -m core.<command>``
hand-offs, and nothing in ``core`` imports it.
"""

__version__ = "0.1.0"
