"""``python -m core.plan``: the command lives in :mod:`core.cli.plan`; this module only hands off to it."""

if __name__ == "__main__":
    from core.cli.plan import main

    raise SystemExit(main())
