"""``python -m core.plan``: the command lives in :mod:`tools.plan`; this module only hands off to it."""

if __name__ == "__main__":
    from tools.plan import main

    raise SystemExit(main())
