"""``python -m core.report``: the command lives in :mod:`core.cli.report`; this module only hands off to it."""

if __name__ == "__main__":
    from core.cli.report import main

    raise SystemExit(main())
