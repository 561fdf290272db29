"""``python -m core.generate``: the command lives in :mod:`tools.generate`; this module only hands off to it."""

if __name__ == "__main__":
    from tools.generate import main

    raise SystemExit(main())
