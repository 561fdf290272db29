"""``python -m core.generate``: the command lives in :mod:`core.cli.generate`; this module only hands off to it."""

if __name__ == "__main__":
    from core.cli.generate import main

    raise SystemExit(main())
