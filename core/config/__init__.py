"""Run configuration: TOML files with extends and overrides, the core's own sections, option values."""
