"""The commands: train, plan, plugins, export, generate, report."""
