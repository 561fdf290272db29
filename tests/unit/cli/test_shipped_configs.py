"""``core.plan`` on every shipped config (world size, tokens per step, parameter counts, FLOPs and the
throughput a config documents) and ``core.plugins``' listing of every slot and provider, in this
process."""

from __future__ import annotations

import json

from conftest import main_here


def test_plan_runs_on_every_shipped_config(capsys, monkeypatch):
    from conftest import REPO

    from core.cli.plan import main

    monkeypatch.chdir(REPO)  # in this process (one import of torch for the four plans), as `python -m core.plan` from the repository
    for name, nproc in [("debug_cpu", 2), ("50m_a100", 1), ("1b_h100", 8), ("xlarge_8xa100", 8)]:
        # the big configs' data lives on their machines: check the config alone there
        only = [] if name == "debug_cpu" else ["--config-only"]
        code = main(["--config", f"train_configs/{name}.toml", f"--nproc={nproc}", "--json", *only])
        out, err = capsys.readouterr()
        assert code == 0, err
        plan = json.loads(out)
        assert plan["world_size"] == nproc
        assert plan["tokens_per_step"] == plan["micro_batch"] * plan["seq_len"] * nproc * plan["grad_accum"]
        if name == "1b_h100":
            assert plan["params_total"] == 1_241_581_568
            assert plan["micro_batch"] == plan["micro_batch_candidates"][0] == 16  # "auto": the estimate is for the largest
            assert plan["flops_per_token"] == 6 * (plan["params_non_embedding"] + 131_072 * 2048) + 12 * 16 * 2048 * 2048
        assert set(plan["memory_per_rank"]) >= {"weights_gib", "grads_gib", "optimizer_gib", "activations_gib"}
        if name == "xlarge_8xa100":  # the 1.46B-on-8xA100 document: 131,072 tokens/step, 11B tokens at 79,200 tokens/s
            assert plan["params_total"] == 1_461_413_760
            assert (plan["tokens_per_step"], plan["micro_batch"], plan["grad_accum"], plan["seq_len"]) == (131_072, 8, 1, 2048)
            assert plan["steps"] == 83_924 and plan["tokens_per_s"] == 79_200
            assert plan["eta_s"] == plan["total_tokens"] / 79_200 and round(plan["eta_hours"], 1) == 38.6


def test_plugins_listing_shows_every_slot_and_provider():
    from core.cli.plugins import main

    code, out, err = main_here(main)  # the command line itself: test_example_plugin.py's listing
    assert code == 0, err
    for slot in ("model:", "parallelism:", "precision:", "data:", "optimizer:", "lr_schedule:", "monitor:"):
        assert slot in out
    assert "llama3" in out and "[from plait, plugin 'llama3']" in out
    assert "lr              float = 0.0003  # peak learning rate" in out
