"""``python -m core.plugins``: the command lives in :mod:`core.cli.plugins`; this module only hands off to it."""

if __name__ == "__main__":
    from core.cli.plugins import main

    raise SystemExit(main())
