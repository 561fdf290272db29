"""The plugin contract: each slot's protocol and members, hooks, options, the registry, errors and the logger."""
