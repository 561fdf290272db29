"""Parallelism settings refused before a run, in one line with exit 2: an HSDP ``replicate`` that does not
divide the world size, and ``single`` asked to run on more than one process."""

from __future__ import annotations

from conftest import main_here


def test_hsdp_replicate_must_divide_world(tiny_config):
    from core.cli.train import main

    code, _, err = main_here(main, "--config", str(tiny_config()), "--parallelism.name=fsdp2", "--parallelism.replicate=2")
    assert code == 2
    assert "replicate = 2 does not divide the world size 1" in err


def test_single_refuses_many_ranks(tiny_config):
    from core.cli.plan import main

    code, _, err = main_here(main, "--config", str(tiny_config()), "--parallelism.name=single", "--nproc=2")
    assert code == 2 and "'single' runs on one process, not 2" in err
