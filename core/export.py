"""``python -m core.export``: the command lives in :mod:`core.cli.export`; this module only hands off to it."""

if __name__ == "__main__":
    from core.cli.export import main

    raise SystemExit(main())
