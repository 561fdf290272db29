"""When a run stops, and when it saves: small pure functions, the whole policy in one place.

After every step each rank contributes what it knows (a monitor asked to
stop, a signal arrived, too many non-finite steps in a row) and one
all-reduce of the maximum makes every rank see the same :class:`Agreed`
facts, so every rank takes the same decision at the same step boundary.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

# Why a run ended; plait_train_end receives it and exit_status.json records it.
COMPLETED, DATA_END, SIGNAL, REQUESTED, DIVERGED = "completed", "data_end", "signal", "requested", "diverged"


@dataclass(frozen=True)
class Agreed:
    """The maximum over all ranks of each fact, after one step."""

    stop_with_checkpoint: int = 0  # a monitor (on some rank) asked to stop and save
    stop_without_checkpoint: int = 0  # ... asked to stop without saving
    signal: int = 0  # SIGTERM/SIGINT/SIGHUP number, 0 for none
    diverged: int = 0  # more non-finite steps in a row than train.max_nonfinite_steps
    exit_code: int = 0  # the exit code a stop request carries

    def as_list(self) -> list[int]:
        return [int(v) for v in astuple(self)]

    @classmethod
    def from_list(cls, values: list[int]) -> "Agreed":
        return cls(*values)


def is_log_step(step: int, log_every: int, total_steps: int) -> bool:
    """Metrics are logged every ``log_every`` steps and at the last step."""
    return step % log_every == 0 or step == total_steps


def save_due(step: int, every: int, total_steps: int) -> bool:
    """A periodic checkpoint is due (the last step's save is the end-of-run save)."""
    return bool(every) and step % every == 0 and step < total_steps


def stop_reason(agreed: Agreed) -> str | None:
    """Why the run must stop after this step, or None to go on. Divergence comes first (its
    state must not be saved), then a signal (pre-emption: save and go), then a request."""
    if agreed.diverged:
        return DIVERGED
    if agreed.signal:
        return SIGNAL
    if agreed.stop_with_checkpoint or agreed.stop_without_checkpoint:
        return REQUESTED
    return None


def final_save(reason: str, at_end: bool, on_stop: bool, request_wants_checkpoint: bool) -> bool:
    """Is a checkpoint written as the run ends? ``at_end``/``on_stop`` are checkpoint options;
    ``request_wants_checkpoint``: the stop request (if any) asked for one."""
    return {
        COMPLETED: at_end,
        DATA_END: at_end,
        SIGNAL: on_stop,
        REQUESTED: on_stop and request_wants_checkpoint,
        DIVERGED: False,  # a diverged state is never saved
    }[reason]
