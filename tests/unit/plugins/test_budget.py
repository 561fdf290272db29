"""The budget guard in this process, driven by a fake clock and a budget file: bad or stale files warn and
never crash or disable the cap, checks follow the clock, dry runs only log, only rank 0 decides, and
billed time counts startup, steps a crash threw away, a launcher's back-offs and this process's life on
the monotonic clock, never another run's ledger."""

from __future__ import annotations

import datetime
import json

import pytest
from shared import budget_file


def guard(tmp_path, **opts):
    """A BudgetGuard driven directly, with a real Run object and the fake clock."""
    from core.contract.protocols import DistInfo
    from core.contract.run import Run
    from plugins.monitors.budget_guard import BudgetGuard, BudgetGuardOptions

    defaults = dict(budget_file=str(tmp_path / "budget.json"), warn_usd=30.0, cap_usd=35.0, check_every_s=0.0)
    g = BudgetGuard(BudgetGuardOptions(**{**defaults, **opts}))
    run = Run(config={}, output_dir=tmp_path, dist=DistInfo(), total_steps=100, tokens_per_step=1, step=10)
    return g, run


@pytest.fixture
def clock(tmp_path, monkeypatch):
    f = tmp_path / "clock"
    f.write_text("1800000000")
    import plugins.monitors.budget_guard as budget_guard

    monkeypatch.setattr(budget_guard, "now", lambda: float(f.read_text().strip()))
    monkeypatch.setattr(budget_guard, "elapsed", lambda: float(f.read_text().strip()), raising=False)  # the monotonic clock too
    return f


@pytest.mark.parametrize("content", ["{not json", json.dumps({"spent_usd": "lots"}), None, "[" * 5000 + "]" * 5000])
def test_malformed_or_missing_file_warns_never_crashes(tmp_path, clock, capsys, content):
    if content is not None:
        (tmp_path / "budget.json").write_text(content)
    g, run = guard(tmp_path)
    g.plait_step_end(run=run, step=10, metrics={})
    assert run.stop is None and "plait: warning: budget_guard: budget file" in capsys.readouterr().err


def test_stale_file_warns_once(tmp_path, clock, capsys):
    budget_file(tmp_path / "budget.json", spent=1, projected=2, age_s=3600)
    g, run = guard(tmp_path)
    for step in (10, 11):
        g.plait_step_end(run=run, step=step, metrics={})
    err = capsys.readouterr().err
    assert err.count("is stale (3,600 s old") == 1 and run.stop is None


def test_check_interval_follows_the_clock(tmp_path, clock, capsys):
    budget_file(tmp_path / "budget.json", spent=36, projected=40)
    g, run = guard(tmp_path, check_every_s=60.0)
    g.last_check = 1_800_000_000.0 - 30  # checked 30 s ago
    g.plait_step_end(run=run, step=10, metrics={})
    assert run.stop is None
    clock.write_text(str(1_800_000_000 + 31))
    budget_file(tmp_path / "budget.json", spent=36, projected=40, clock=1_800_000_031)
    g.plait_step_end(run=run, step=11, metrics={})
    assert run.stop is not None and run.stop.exit_code == 76 and not run.stop.checkpoint


def test_dry_run_only_logs(tmp_path, clock, capsys):
    budget_file(tmp_path / "budget.json", spent=36, projected=40)
    g, run = guard(tmp_path, dry_run=True)
    g.plait_step_end(run=run, step=10, metrics={})
    assert run.stop is None and "[dry run] would stop now without a checkpoint" in capsys.readouterr().err


def test_computed_spend_is_cumulative_wall_time(tmp_path, clock):
    g, run = guard(tmp_path, budget_file="", rate_usd_per_hr=2.0, gpus=4, warn_usd=0.0, cap_usd=100.0)
    run.state["wall_time_s"] = 3600 * 10  # 10 h so far (restored from checkpoints across resumes)
    g.plait_step_end(run=run, step=10, metrics={})  # spent 80, projected 80 + 90 h x 8 $/h
    assert run.state["budget_spent_usd"] == pytest.approx(80.0)
    assert run.stop is not None and run.stop.exit_code == 75 and run.stop.checkpoint


def test_only_rank_zero_decides(tmp_path, clock):
    from core.contract.protocols import DistInfo

    budget_file(tmp_path / "budget.json", spent=36, projected=40)
    g, run = guard(tmp_path)
    run.dist = DistInfo(rank=1, world_size=2)
    g.plait_step_end(run=run, step=10, metrics={})
    assert run.stop is None


def write_budget(path, clock=1_800_000_000.0, age_s=0.0, **fields):
    stamp = datetime.datetime.fromtimestamp(clock - age_s, datetime.timezone.utc).isoformat()
    path.write_text(json.dumps({"last_update_utc": stamp, **fields}))


@pytest.mark.parametrize(
    "fields, age_s, warning",
    [
        ({"spent_usd": float("nan"), "projected_total_usd": 1.0}, 0.0, "spent_usd = nan, expected a finite number >= 0"),
        ({"spent_usd": -5.0, "projected_total_usd": -5.0}, 0.0, "spent_usd = -5.0, expected a finite number >= 0"),
        ({"spent_usd": 1.0, "projected_total_usd": float("inf")}, 0.0, "projected_total_usd = inf"),
        ({"spent_usd": "lots"}, 0.0, "spent_usd = 'lots'"),
        ({"spent_usd": True}, 0.0, "spent_usd = True"),
        ({"spent_usd": 1.0, "projected_total_usd": 2.0}, -7200.0, "is 7,200 s in the future"),
    ],
)
def test_bad_budget_figures_never_disable_the_cap(tmp_path, clock, capsys, fields, age_s, warning):
    """NaN, negative, non-numeric or future-dated figures: one warning, and the computed spend
    (here $40 > the $35 cap) still stops the run."""
    write_budget(tmp_path / "budget.json", age_s=age_s, **fields)
    g, run = guard(tmp_path, rate_usd_per_hr=4.0, gpus=1)
    run.state["wall_time_s"] = 10 * 3600
    for step in (10, 11):
        g.plait_step_end(run=run, step=step, metrics={})
    err = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert len(err) == 1 and warning in err[0], err
    assert run.stop is not None and run.stop.exit_code == 76


def test_bad_budget_file_keeps_the_last_good_figures(tmp_path, clock, capsys):
    write_budget(tmp_path / "budget.json", spent_usd=30.0, projected_total_usd=34.0)
    g, run = guard(tmp_path)
    g.plait_step_end(run=run, step=10, metrics={})
    assert run.stop is None and run.state["budget_spent_usd"] == 30.0
    write_budget(tmp_path / "budget.json", spent_usd=float("nan"), projected_total_usd=float("nan"))
    g.plait_step_end(run=run, step=11, metrics={})
    assert run.state["budget_spent_usd"] == 30.0 and "keeping the last good figures (spent $30.00)" in capsys.readouterr().err
    write_budget(tmp_path / "budget.json", spent_usd=36.0)  # good again: the cap holds
    g.plait_step_end(run=run, step=12, metrics={})
    assert run.stop is not None and run.stop.exit_code == 76


def test_no_figures_at_all_is_said_once(tmp_path, clock, capsys):
    (tmp_path / "budget.json").write_text('{"spent_usd": null}')
    g, run = guard(tmp_path)
    for step in (10, 11):
        g.plait_step_end(run=run, step=step, metrics={})
    err = capsys.readouterr().err
    assert err.count("cap_usd/warn_usd cannot be checked yet") == 1 and run.stop is None


# -- billed time across crashes: the ledger -----------------------------------------------


def attempt(tmp_path, monkeypatch, clock, age_s=0.0, wall_s=3600.0, lineage="run-a", **opts):
    """One process of a run under the guard (computed spend: $2 per GPU-hour, one GPU): started
    ``age_s`` seconds before its train start, resumed with ``wall_s`` of checkpointed wall time."""
    import plugins.monitors.budget_guard as budget_guard

    monkeypatch.setattr(budget_guard, "process_age_s", lambda: age_s)
    g, run = guard(tmp_path, **{"budget_file": "", "rate_usd_per_hr": 2.0, "gpus": 1, "warn_usd": 0.0, "cap_usd": 100.0, **opts})
    run.state.update(lineage=lineage, wall_time_s=wall_s)
    g.plait_train_start(run=run)
    return g, run


def tick(clock, seconds: float) -> None:
    clock.write_text(str(float(clock.read_text()) + seconds))


def test_billed_time_counts_startup_and_the_steps_a_crash_threw_away(tmp_path, clock, monkeypatch):
    """The checkpoints' wall time misses a process's startup and whatever it ran after its last
    checkpoint; a crash-and-restart loop would spend without the guard seeing it. The ledger sees it."""
    g, run = attempt(tmp_path, monkeypatch, clock, age_s=600.0)  # 10 minutes of startup (resume, compile)
    tick(clock, 7200)  # two hours of training past the checkpoint (wall time 1 h), then a SIGKILL
    g.plait_step_end(run=run, step=10, metrics={})
    billed = 3600 + 600 + 7200
    assert run.state["budget_spent_usd"] == pytest.approx(billed / 3600 * 2.0)
    ledger = json.loads((tmp_path / "budget_ledger.json").read_text())
    assert ledger["lineage"] == "run-a" and ledger["billed_s"] == pytest.approx(billed)

    # the restart resumes the same checkpoint (wall time 1 h again): spend goes on from the ledger
    g2, run2 = attempt(tmp_path, monkeypatch, clock)
    tick(clock, 60)
    g2.plait_step_end(run=run2, step=10, metrics={})
    assert run2.state["budget_spent_usd"] == pytest.approx((billed + 60) / 3600 * 2.0)
    g2.plait_train_end(run=run2, reason="completed")
    assert json.loads((tmp_path / "budget_ledger.json").read_text())["billed_s"] == pytest.approx(billed + 60)


def test_a_restart_after_a_stop_over_the_cap_stops_at_once(tmp_path, clock, monkeypatch):
    """Stopped over the cap without a checkpoint (exit 76), restarted by hand: the checkpoint's
    wall time is under the cap, the money spent is not."""
    g, run = attempt(tmp_path, monkeypatch, clock, cap_usd=5.0)
    tick(clock, 3 * 3600)
    g.plait_step_end(run=run, step=10, metrics={})
    assert run.stop is not None and run.stop.exit_code == 76
    g2, run2 = attempt(tmp_path, monkeypatch, clock, cap_usd=5.0)
    tick(clock, 1)
    g2.plait_step_end(run=run2, step=10, metrics={})
    assert run2.stop is not None and run2.stop.exit_code == 76 and not run2.stop.checkpoint


def test_another_runs_ledger_is_not_billed(tmp_path, clock, monkeypatch, capsys):
    g, run = attempt(tmp_path, monkeypatch, clock)
    tick(clock, 10 * 3600)
    g.plait_step_end(run=run, step=10, metrics={})
    fresh, run2 = attempt(tmp_path, monkeypatch, clock, wall_s=0.0, lineage="run-b")  # a new run in the same folder
    tick(clock, 3600)
    fresh.plait_step_end(run=run2, step=10, metrics={})
    assert run2.state["budget_spent_usd"] == pytest.approx(2.0)
    assert json.loads((tmp_path / "budget_ledger.json").read_text())["lineage"] == "run-b"
    (tmp_path / "budget_ledger.json").write_text("{cut")  # a damaged ledger: a warning, the wall time bounds the spend
    g3, run3 = attempt(tmp_path, monkeypatch, clock, lineage="run-b")
    g3.plait_step_end(run=run3, step=10, metrics={})
    assert run3.state["budget_spent_usd"] == pytest.approx(2.0) and "budget_ledger.json is not usable" in capsys.readouterr().err


def test_process_age_is_this_process_lifetime():
    from plugins.monitors.budget_guard import process_age_s

    age = process_age_s()
    assert 0.0 < age < float(open("/proc/uptime").read().split()[0]) + 1


def test_a_jump_of_the_wall_clock_neither_bills_nor_pauses_the_checks(tmp_path, clock, monkeypatch):
    """Elapsed time is measured on the monotonic clock; the wall clock dates the figures only. With the wall
    clock set a day forward or back (an NTP step, a restored VM), a check bills only the monotonic time passed
    and stops nothing."""
    import plugins.monitors.budget_guard as budget_guard

    g, run = attempt(tmp_path, monkeypatch, clock, cap_usd=25.0)  # 1 h billed so far ($2), $20 projected
    g.options.check_every_s = 60.0
    for i, jump in enumerate((86400.0, -86400.0), start=1):
        monkeypatch.setattr(budget_guard, "now", lambda jump=jump: float(clock.read_text()) + jump)  # only the wall clock jumps
        tick(clock, 61)  # one check interval on the monotonic clock
        run.state.pop("budget_spent_usd", None)
        g.plait_step_end(run=run, step=10, metrics={})
        assert run.stop is None and run.state["budget_spent_usd"] == pytest.approx((3600 + 61 * i) / 3600 * 2.0)  # checked, the jump not billed


def test_under_a_launcher_billed_time_counts_its_back_offs_and_starts(tmp_path, clock, monkeypatch):
    """Under a launcher that says since when it has held the machine (PLAIT_LAUNCHER_SINCE, on the machine's
    boot clock), billed time is at least every second since then: back-offs after a crash and each attempt's
    torchrun start included; a second launcher (a start by hand, later) bills from its own start."""
    import plugins.monitors.budget_guard as budget_guard

    monkeypatch.setattr(budget_guard, "since_boot", lambda: float(clock.read_text()))  # the boot clock, faked with the rest
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    monkeypatch.setenv("PLAIT_LAUNCHER_SINCE", f"{boot} {float(clock.read_text()) - 100}")  # began holding the node 100 s ago
    g, run = attempt(tmp_path, monkeypatch, clock, age_s=10.0, wall_s=0.0)
    tick(clock, 50)
    g.plait_step_end(run=run, step=10, metrics={})  # then a crash
    assert json.loads((tmp_path / "budget_ledger.json").read_text())["billed_s"] == pytest.approx(150)
    tick(clock, 300)  # the launcher's back-off, and torchrun starting again
    g2, run2 = attempt(tmp_path, monkeypatch, clock, age_s=5.0, wall_s=0.0)
    g2.plait_step_end(run=run2, step=10, metrics={})
    assert run2.state["budget_spent_usd"] == pytest.approx(450 / 3600 * 2.0)  # the ledger alone: 150 + 5
    tick(clock, 1000)  # the launcher gave up; a day's gap, the node released; a new launcher now
    monkeypatch.setenv("PLAIT_LAUNCHER_SINCE", f"{boot} {float(clock.read_text())}")
    g3, run3 = attempt(tmp_path, monkeypatch, clock, age_s=5.0, wall_s=0.0)
    g3.plait_step_end(run=run3, step=10, metrics={})
    assert run3.state["budget_spent_usd"] == pytest.approx(455 / 3600 * 2.0)
    monkeypatch.setenv("PLAIT_LAUNCHER_SINCE", f"another-boot {float(clock.read_text()) - 10**6}")  # not this boot: not believed
    g4, run4 = attempt(tmp_path, monkeypatch, clock, age_s=0.0, wall_s=0.0)
    g4.plait_step_end(run=run4, step=10, metrics={})
    assert run4.state["budget_spent_usd"] == pytest.approx(455 / 3600 * 2.0)
