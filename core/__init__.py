"""plait core: the plugin contract (protocols, hooks, options, discovery) and the training loop.

The core knows no concrete plugin. Everything it trains with is found through
the ``plait`` entry-point group (see :mod:`core.hookspecs`). Beside it: :mod:`preflight`
(config file to checked components), :mod:`checkpointing` (the durable state),
:mod:`dataloading` (the index-addressed loader) and :mod:`tools` (the commands).
"""

__version__ = "0.1.0"
