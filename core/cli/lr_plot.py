"""``python -m core.plan --plot-lr PNG``: the run's learning rate at every step, as the trainer
will set it, drawn with matplotlib; the path is checked before any expensive work."""

from __future__ import annotations

from pathlib import Path

from core.contract.errors import ConfigError


def lr_values(prep) -> list[float]:
    """The learning rate of every step of the run, as the trainer will set it."""
    schedule = prep.components["lr_schedule"]
    peak = prep.components["optimizer"].options.lr
    total = prep.total_steps
    return [peak * schedule.multiplier(s, total) for s in range(total)]


def check_plot_path(path: str) -> None:
    """``--plot-lr PATH`` can be drawn: matplotlib is installed, knows the suffix, and the folder takes a file."""
    from core.runtime.made_folders import probe_folder

    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as e:
        raise ConfigError(f"--plot-lr needs matplotlib (pip install 'plait[report]'): {e}") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower().lstrip(".") not in formats:
        raise ConfigError(f"--plot-lr {path}: expected a file name ending in one of .{', .'.join(sorted(formats))}")
    if Path(path).is_dir():
        raise ConfigError(f"--plot-lr {path}: is a folder, expected a file name")
    probe_folder(Path(path).parent, "--plot-lr folder")


def plot_lr(prep, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = lr_values(prep)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(values) + 1), values)
    name = prep.rc.slots["lr_schedule"].component.name
    ax.set(xlabel="step", ylabel="learning rate", title=f"{name}: {prep.source}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
