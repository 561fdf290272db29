"""``python -m core.report``: the command lives in :mod:`tools.report`; this module only hands off to it."""

if __name__ == "__main__":
    from tools.report import main

    raise SystemExit(main())
