"""plait core: protocols, plugin discovery, configuration and the training loop.

The core knows no concrete plugin. Everything it trains with is found through
the ``plait`` entry-point group (see :mod:`core.hookspecs`).
"""

__version__ = "0.1.0"
