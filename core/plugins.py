"""``python -m core.plugins``: the command lives in :mod:`tools.plugins`; this module only hands off to it."""

if __name__ == "__main__":
    from tools.plugins import main

    raise SystemExit(main())
