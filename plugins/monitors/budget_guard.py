"""``budget_guard``: keep a rented-GPU run inside its dollar budget.

Spend comes from a budget file that a sidecar keeps current
(``{"spent_usd", "rate_usd_per_hr", "hours_elapsed", "projected_total_usd",
"last_update_utc"}``), or, without one, from ``rate_usd_per_hr x GPUs x billed
time``. Billed time is every second a process of this run has lived, across
restarts: startup, resume and compile included, and the steps a crash, a kill
or a stop without a checkpoint threw away, which the checkpoints' wall time
never sees. Rank 0 keeps it in ``<output_dir>/budget_ledger.json`` (written
at each check and at the end, replaced atomically and fsynced; a ledger of
another run in the folder is ignored and replaced), so a restart after a crash,
or after a stop over the cap, starts from what was really spent. Under a
launcher that says since when it has held the machine (``PLAIT_LAUNCHER_SINCE``,
set by ``launchers/remote.sh``), billed time is at least every second since
then, its back-offs and the starts of its attempts included; time between two
launchers, or across a reboot, is not seen (a sidecar's budget file is). Every ``check_every_s`` seconds rank 0 checks, in this order:

* spent over ``cap_usd``: stop at once, no checkpoint, exit code 76;
* projected total over ``cap_usd``: checkpoint, then exit code 75;
* spent over ``warn_usd``: an alert (log line, and ``alert_command`` if set), once. The command runs
  detached (:mod:`plugins.monitors.alert_command`): its own session, its output read by the guard,
  ended after ``alert_timeout_s``, so a command that hangs never holds the run or its launcher.

A missing, stale or malformed budget file is a warning, never a crash, and
never switches the cap off: a file whose figures are not finite numbers >= 0,
or whose ``last_update_utc`` lies in the future, is not used; the guard goes on
with the last good figures it read (or the computed spend, whichever is
higher), and says so when it has nothing to enforce the cap with.
``dry_run`` logs what would happen and never stops. Before training, a run
whose plan already projects over the cap is refused (exit 2) unless
``--budget.force=true``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from core.api import ConfigError, hookimpl, log, option, replace_durable
from plugins.monitors.alert_command import DetachedCommand

EXIT_PROJECTED_OVER_CAP = 75
EXIT_SPENT_OVER_CAP = 76
FUTURE_TOLERANCE_S = 300.0  # clock skew allowed between the sidecar and this node


def amount(data: dict, key: str) -> float:
    """A dollar figure of the budget file: a finite number >= 0 (ValueError otherwise)."""
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} = {value!r}, expected a finite number >= 0")
    return float(value)


def now() -> float:
    """The current UNIX time (one function, so that tests can stand in a clock of their own)."""
    return time.time()


def elapsed() -> float:
    """A monotonic clock, for the time that passes (billed time, check intervals): unlike ``now()``
    it never jumps when the system clock is set (an NTP step, a VM's clock set after a restore)."""
    return time.monotonic()


LEDGER_FILE = "budget_ledger.json"


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``), so that billed time includes the
    startup before training; 0 where it cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks after boot
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


LAUNCHER_ENV = "PLAIT_LAUNCHER_SINCE"  # "<boot id> <seconds since boot>": when a launcher began holding this machine


def since_boot() -> float:
    """Seconds since this machine booted (``/proc/uptime``: one clock for every process, the launcher's too)."""
    return float(Path("/proc/uptime").read_text().split()[0])


def launcher_session() -> tuple[str, float] | None:
    """(the launcher's ``PLAIT_LAUNCHER_SINCE``, the seconds since boot at which it began holding this
    machine), when it set one for this boot that is not in the future; None otherwise."""
    value = os.environ.get(LAUNCHER_ENV, "")
    try:
        boot, text = value.split()
        since = float(text)
        if boot != Path("/proc/sys/kernel/random/boot_id").read_text().strip() or not 0 <= since <= since_boot():
            return None
    except (ValueError, OSError):
        return None
    return value, since


@dataclass
class BudgetGuardOptions:
    budget_file: str = option("", "JSON kept current by a sidecar; empty: compute spend from rate x GPUs x billed time (budget_ledger.json)", path=True)
    rate_usd_per_hr: float = option(0.0, "price of one GPU-hour, for computed spend and the pre-flight projection", ge=0)
    gpus: int = option(0, "GPUs billed; 0 means the world size", ge=0)
    warn_usd: float = option(0.0, "alert once when spend passes this; 0 disables", ge=0)
    cap_usd: float = option(0.0, "hard budget; 0 disables the stops", ge=0)
    check_every_s: float = option(60.0, "seconds between checks", ge=0)
    stale_after_s: float = option(900.0, "a budget file older than this is stale (warning, computed spend used when possible)", gt=0)
    alert_command: str = option("", "shell command run once on the warn threshold (PLAIT_BUDGET_* in its environment), detached from the run's output")
    alert_timeout_s: float = option(60.0, "seconds alert_command may run before it (and what it started) is ended with a warning", gt=0)
    dry_run: bool = option(False, "log what each threshold would do, never stop")
    expected_tokens_per_s: float = option(
        0.0, "whole-run tokens/s (all devices) for the pre-flight projection and core.plan's ETA; `python -m core.plan --measure` measures it; 0 skips it", ge=0
    )


class BudgetGuard:
    def __init__(self, options: BudgetGuardOptions) -> None:
        self.options = options
        self.last_check = -float("inf")
        self.alerted = False
        self.warned: set[str] = set()
        self.last_good: dict | None = None  # the last usable figures of the budget file
        self.attempt_start: float | None = None  # when this process started (the clock of elapsed())
        self.billed_before = 0.0  # billed seconds of this run's earlier processes (the ledger)
        self.launcher: str | None = None  # PLAIT_LAUNCHER_SINCE of the launcher that started this process
        self.launcher_since = 0.0  # when it began holding the machine, in seconds since boot
        self.before_launcher = 0.0  # billed seconds of this run before that launcher began
        self.alert: DetachedCommand | None = None  # alert_command, once started

    # -- before training ------------------------------------------------------
    @hookimpl
    def plait_preflight(self, prep, force: bool) -> None:
        o = self.options
        if not (o.cap_usd and o.rate_usd_per_hr and o.expected_tokens_per_s):
            return
        gpus = o.gpus or prep.world_size
        hours = prep.total_steps * prep.tokens_per_step / o.expected_tokens_per_s / 3600
        cost = hours * gpus * o.rate_usd_per_hr
        if cost > o.cap_usd and not force:
            raise ConfigError(
                f"[monitors.budget_guard] the plan projects ${cost:,.2f} ({hours:,.1f} h x {gpus} GPUs x ${o.rate_usd_per_hr}/h) "
                f"over cap_usd = {o.cap_usd}; pass --budget.force=true to start anyway"
            )

    # -- during training -------------------------------------------------------
    def _warn(self, run, key: str, text: str) -> None:
        # Once per guard and key, not log's once= (that is per process, and a process may run several guards).
        if key not in self.warned:
            self.warned.add(key)
            log.warn(f"budget_guard: {text}")

    def read_file(self, run) -> dict | None:
        o = self.options
        path = Path(o.budget_file)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise TypeError(f"expected a JSON object, got {type(data).__name__}")
            spent = amount(data, "spent_usd")
            projected = max(amount(data, "projected_total_usd"), spent) if "projected_total_usd" in data else spent
            stamp = datetime.datetime.fromisoformat(str(data["last_update_utc"]).replace("Z", "+00:00"))
            if stamp.tzinfo is None:
                stamp = stamp.replace(tzinfo=datetime.timezone.utc)
        except FileNotFoundError:
            self._warn(run, "missing", f"budget file {path} not found; {self._fallback()}")
            return None
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
            self._warn(run, "malformed", f"budget file {path} is not usable ({type(e).__name__}: {e}); {self._fallback()}")
            return None
        age = now() - stamp.timestamp()
        if age < -FUTURE_TOLERANCE_S:
            self._warn(
                run, "future", f"budget file {path}: last_update_utc {stamp.isoformat()} is {-age:,.0f} s in the future; not using it, {self._fallback()}"
            )
            return None
        if age > o.stale_after_s:
            self._warn(run, "stale", f"budget file {path} is stale ({age:,.0f} s old > stale_after_s {o.stale_after_s:g})")
            if o.rate_usd_per_hr:
                return None
        self.last_good = {"spent": spent, "projected": projected}
        return self.last_good

    def _fallback(self) -> str:
        if self.last_good is not None:
            return f"keeping the last good figures (spent ${self.last_good['spent']:,.2f})"
        return "using computed spend" if self.options.rate_usd_per_hr else "no spend figure to check the cap against yet"

    def billed_s(self, run) -> float:
        """Seconds this run's processes have lived, all attempts together (at least the wall time
        its checkpoints carry)."""
        wall = run.state.get("wall_time_s", 0.0)
        if self.attempt_start is None:  # no train start seen: the checkpoints' wall time only
            return wall
        billed = max(wall, self.billed_before + elapsed() - self.attempt_start)
        if self.launcher is None:
            return billed
        return max(billed, self.before_launcher + since_boot() - self.launcher_since)

    def ledger(self, run) -> Path:
        return Path(run.output_dir) / LEDGER_FILE

    def read_ledger(self, run) -> tuple[float, str | None, float]:
        """(billed seconds, the launcher it was written under, billed seconds before that launcher)
        the ledger holds for this run (its lineage); zeros for none or another run's."""
        path = self.ledger(run)
        try:
            data = json.loads(path.read_text())
            if data.get("lineage") != run.state.get("lineage"):
                return 0.0, None, 0.0
            billed, before = float(data["billed_s"]), float(data.get("before_launcher_s", 0.0))
            ok = all(math.isfinite(x) and x >= 0 for x in (billed, before))
            return (billed, data.get("launcher"), before) if ok else (0.0, None, 0.0)
        except FileNotFoundError:
            return 0.0, None, 0.0
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            self._warn(run, "ledger", f"{path} is not usable ({type(e).__name__}: {e}); billing from the checkpoint's wall time")
            return 0.0, None, 0.0

    def record(self, run) -> None:
        """Write the ledger (rank 0, computed spend only)."""
        if self.attempt_start is None or not self.options.rate_usd_per_hr:
            return
        stamp = datetime.datetime.fromtimestamp(now(), datetime.timezone.utc).isoformat()
        try:
            replace_durable(
                self.ledger(run),
                json.dumps(
                    {
                        "lineage": run.state.get("lineage"),
                        "billed_s": self.billed_s(run),
                        "launcher": self.launcher,
                        "before_launcher_s": self.before_launcher,
                        "updated_utc": stamp,
                    }
                )
                + "\n",
            )
        except OSError as e:  # a full disk: the checkpoints' wall time still bounds the spend from below
            self._warn(run, "ledger_write", f"cannot write {self.ledger(run)} ({e}); billing from the wall time until it can")

    def computed(self, run) -> dict:
        o = self.options
        gpus = o.gpus or run.dist.world_size
        spent = self.billed_s(run) / 3600 * gpus * o.rate_usd_per_hr
        done = max(run.step, 1)
        remaining_h = run.state.get("wall_time_s", 0.0) / 3600 / done * (run.total_steps - run.step)  # at the training pace
        return {"spent": spent, "projected": spent + remaining_h * gpus * o.rate_usd_per_hr}

    def spend(self, run) -> dict | None:
        """The figures to check: the budget file's; when it is unusable, the higher of the last
        good figures and the computed spend; None (warned) when there is nothing to go on."""
        o = self.options
        figures = self.read_file(run) if o.budget_file else None
        if figures is None:
            options = [f for f in (self.last_good if o.budget_file else None, self.computed(run) if o.rate_usd_per_hr else None) if f is not None]
            figures = max(options, key=lambda f: (f["spent"], f["projected"])) if options else None
        if figures is None and (o.cap_usd or o.warn_usd):
            self._warn(run, "no_figures", "cap_usd/warn_usd cannot be checked yet: no usable budget file and rate_usd_per_hr is 0")
        return figures

    def act(self, run, action: str, reason: str) -> None:
        o = self.options
        prefix = "[dry run] would " if o.dry_run else ""
        log.note(f"budget_guard: {prefix}{action}: {reason}")
        if o.dry_run:
            return
        if action == "alert":
            if o.alert_command:
                env = dict(os.environ, PLAIT_BUDGET_REASON=reason, PLAIT_BUDGET_STEP=str(run.step))
                self.alert = DetachedCommand(o.alert_command, env, o.alert_timeout_s, "budget_guard: alert_command")
        elif action == "checkpoint and stop":
            run.request_stop(f"budget: {reason}", checkpoint=True, source="budget_guard", exit_code=EXIT_PROJECTED_OVER_CAP)
        else:
            run.request_stop(f"budget: {reason}", checkpoint=False, source="budget_guard", exit_code=EXIT_SPENT_OVER_CAP)

    @hookimpl
    def plait_train_start(self, run):
        if not run.dist.is_main:
            return
        self.attempt_start = elapsed() - process_age_s()
        # earlier processes: the ledger, or at least what their checkpoints' wall time carries
        ledger, ledger_launcher, ledger_before = self.read_ledger(run)
        self.billed_before = max(ledger, run.state.get("wall_time_s", 0.0))
        session = launcher_session()  # the same launcher as the ledger's: what was billed before it began
        self.launcher, self.launcher_since = session if session else (None, 0.0)
        self.before_launcher = ledger_before if self.launcher is not None and ledger_launcher == self.launcher else self.billed_before

    @hookimpl
    def plait_train_end(self, run, reason):
        if run is not None and run.dist.is_main:
            self.record(run)
        if self.alert is not None:
            self.alert.finish()

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if not run.dist.is_main:  # rank 0 decides; the trainer makes every rank follow
            return
        t = elapsed()
        if t - self.last_check < self.options.check_every_s:
            return
        self.last_check = t
        self.record(run)
        figures = self.spend(run)
        if figures is None:
            return
        o = self.options
        spent, projected = figures["spent"], figures["projected"]
        run.state["budget_spent_usd"] = spent
        if o.cap_usd and spent > o.cap_usd:
            self.act(run, "stop now without a checkpoint", f"spent ${spent:,.2f} > cap ${o.cap_usd:,.2f}")
        elif o.cap_usd and projected > o.cap_usd:
            self.act(run, "checkpoint and stop", f"projected ${projected:,.2f} > cap ${o.cap_usd:,.2f} (spent ${spent:,.2f})")
        elif o.warn_usd and spent > o.warn_usd and not self.alerted:
            self.alerted = True
            self.act(run, "alert", f"spent ${spent:,.2f} > warn ${o.warn_usd:,.2f}")
