"""``python -m core.train``: the command lives in :mod:`core.cli.train`; this module only hands off to it."""

if __name__ == "__main__":
    from core.cli.train import run_and_exit

    run_and_exit()
