"""``python -m core.eval``: the command lives in :mod:`core.cli.eval`; this module only hands off to it."""

if __name__ == "__main__":
    from core.cli.eval import main

    raise SystemExit(main())
