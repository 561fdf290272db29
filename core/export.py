"""``python -m core.export``: the command lives in :mod:`tools.export`; this module only hands off to it."""

if __name__ == "__main__":
    from tools.export import main

    raise SystemExit(main())
