"""``python -m core.report --run DIR --out DIR``: a run's artifacts for a post-mortem or a paper.

Writes into ``--out``:

* ``manifest.json``: seed, library versions, config hash, hardware, world
  size, steps, tokens, dollars spent (budget guard's or computed), and the
  final checkpoint;
* ``metrics.csv``: long format ``step,kind,name,value``, one row per logged
  value (for a resumed run the last value logged for a step wins);
* ``loss-curve.png`` (train and validation), ``gradnorm-curve.png``,
  ``throughput.png`` (matplotlib);
* ``final.safetensors``: the last complete checkpoint's weights (of the run that last
  trained in the checkpoint folder run_info.json names, from any working directory),
  reloaded and compared tensor by tensor before the command succeeds.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from core.contract import log
from core.contract.errors import ArgumentParser, CheckpointError, ConfigError, PlaitError, exit_bad_input
from core.contract.json_rows import restore_not_finite


def read_rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise CheckpointError(f"run {run}: metrics.jsonl not found (enable the jsonl monitor)")
    latest: dict[tuple[str, int], dict] = {}
    for line in path.read_text(errors="replace").splitlines():  # a damaged byte spoils its line alone
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, an integer too long
            continue  # a line cut by a kill, or damaged
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue  # not a metrics row
        restore_not_finite(row)  # NaN and infinity are written as null (strict JSON)
        if row.get("kind") == "resume":  # what was logged past this step is a history the run left
            latest = {k: r for k, r in latest.items() if k[1] <= row["step"]}
        else:
            latest[(row.get("kind", "train"), row["step"])] = row
    return [latest[k] for k in sorted(latest, key=lambda k: (k[1], k[0]))]


def write_csv(rows: list[dict[str, Any]], path: Path) -> int:
    n = 0
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "kind", "name", "value"])
        for row in rows:
            for name, value in row.items():
                if name in ("step", "kind") or isinstance(value, (dict, list)):
                    continue
                w.writerow([row["step"], row.get("kind", "train"), name, value])
                n += 1
    return n


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    made = []

    def figure(name: str, series: list[tuple[str, list, list]], ylabel: str, xlabel: str = "step") -> None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, xs, ys in series:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(out / name)

    figure(
        "loss-curve.png",
        [("train", [r["step"] for r in train], [r["loss"] for r in train])]
        + ([("validation", [r["step"] for r in val], [r["val_loss"] for r in val])] if val else []),
        "loss",
    )
    figure("gradnorm-curve.png", [("grad norm", [r["step"] for r in train], [r["grad_norm"] for r in train])], "gradient norm")
    figure("throughput.png", [("tokens/s", [r["elapsed_s"] / 3600 for r in train], [r["tokens_per_s"] for r in train])], "tokens/s", xlabel="training hours")
    return made


def final_checkpoint(run: Path, config: dict) -> Path | None:
    """The run's newest committed checkpoint: in the checkpoint folder run_info.json names (absolute;
    the config's ``checkpoint.dir`` may be relative to where the run was started, not where the
    report runs; one inside the run folder is taken inside ``run``, wherever the folder was moved or
    copied), of the run that last trained there (``CURRENT_RUN``), as a restart would take it."""
    from core.checkpoint import committed, current_run, lineage_of
    from core.cli.text_codec import read_json

    info = read_json(run / "run_info.json") if (run / "run_info.json").is_file() else {}
    ckpt = config.get("checkpoint", {})
    if isinstance(info, dict) and isinstance(info.get("checkpoint_dir"), str):
        root = Path(info["checkpoint_dir"])
        trained_in = config.get("train", {}).get("output_dir")
        if (
            isinstance(trained_in, str) and trained_in and root.is_relative_to(Path(trained_in).absolute())
        ):  # inside the run folder: follow the folder if it was moved or copied
            root = run / root.relative_to(Path(trained_in).absolute())
    else:  # a run of a plait before run_info.json named it
        root = Path(ckpt["dir"]) if ckpt.get("dir") else run / "checkpoints"
    done = committed(root)
    if (lineage := current_run(root)) is not None and any(lineage_of(p) == lineage for p in done):
        done = [p for p in done if lineage_of(p) == lineage]  # not another run's beside it (allow_foreign)
    return done[-1] if done else None


def export_final(ckpt: Path, out: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from core.weights import checkpoint_model, unique_tensors

    _, _, model = checkpoint_model(ckpt)
    tensors, aliases = unique_tensors(model.state_dict())
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    path = out / "final.safetensors"
    save_file(tensors, str(path), metadata={"plait": json.dumps({"aliases": aliases}, sort_keys=True)})
    reloaded = load_file(str(path))
    for name, t in tensors.items():
        if reloaded[name].dtype != t.dtype or not torch.equal(reloaded[name], t):
            raise CheckpointError(f"{path}: {name} did not reload bit for bit")
    return path


def read_config(run: Path) -> tuple[str, dict[str, Any]]:
    """The text and the tables of the run's config.resolved.toml."""
    from core.config import files as config_io

    path = run / "config.resolved.toml"
    if not path.is_file():
        raise CheckpointError(f"run {run}: config.resolved.toml not found; is this a plait output_dir?")
    try:
        text = path.read_text()
        return text, config_io.tomllib.loads(text)
    except (OSError, UnicodeDecodeError, config_io.tomllib.TOMLDecodeError) as e:
        raise CheckpointError(f"{path}: not readable TOML ({type(e).__name__}: {e})") from None


def manifest(run: Path, rows: list[dict], ckpt: Path | None, resolved_text: str, resolved: dict[str, Any]) -> dict[str, Any]:
    from core.cli.text_codec import read_json

    info = read_json(run / "run_info.json") if (run / "run_info.json").is_file() else {}
    train = [r for r in rows if r.get("kind") == "train"]
    spent = None
    if ckpt is not None:
        state = read_json(ckpt / "state.json")
        train_state = state.get("train")
        spent = train_state.get("budget_spent_usd") if isinstance(train_state, dict) else None  # checked when its weights are read
    if spent is None:  # computed the budget guard's way, when a rate is configured
        guard = resolved.get("monitors", {}).get("budget_guard", {})
        rate = guard.get("rate_usd_per_hr", 0.0)
        if rate and train:
            spent = rate * (guard.get("gpus") or info.get("world_size", 1)) * train[-1]["elapsed_s"] / 3600
    return {
        "run": str(run),
        "seed": resolved.get("train", {}).get("seed"),
        "config_sha256": hashlib.sha256(resolved_text.encode()).hexdigest(),
        "versions": info.get("versions", {}),
        "hardware": {"device": info.get("device"), "device_name": info.get("device_name"), "backend": info.get("backend")},
        "world_size": info.get("world_size"),
        "steps": train[-1]["step"] if train else 0,
        "tokens_seen": train[-1]["tokens_seen"] if train else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "best_val_loss": min((r["val_loss"] for r in rows if r.get("kind") == "val"), default=None),
        "dollars_spent": spent,
        "final_checkpoint": str(ckpt) if ckpt else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m core.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, type=Path, help="a run's output_dir")
    p.add_argument("--out", required=True, type=Path, help="folder to write the report to")
    args = p.parse_args(argv)
    try:
        from core.cli.export import refuse_inside_checkpoint
        from core.cli.staged_output import staged
        from core.runtime.made_folders import probe_folder

        try:
            import matplotlib  # noqa: F401  (the curves; checked before anything is read or written)
        except ImportError as e:
            raise ConfigError(f"core.report draws its curves with matplotlib (pip install 'plait[report]'): {e}") from None
        resolved_text, resolved = read_config(args.run)
        rows = read_rows(args.run)
        ckpt = final_checkpoint(args.run, resolved)
        record = manifest(args.run, rows, ckpt, resolved_text, resolved)  # every run file read before anything is written
        refuse_inside_checkpoint(args.out, "--out")
        probe_folder(args.out, "--out", keep=False)  # staged() makes it, and removes it again if nothing could be written
        with staged(args.out, "report") as out:  # every file whole, or none (a full disk: one line, exit 74)
            made = [out / "metrics.csv"]
            write_csv(rows, made[0])
            made += plot(rows, out)
            if ckpt is not None:
                made.append(export_final(ckpt, out))
            (out / "manifest.json").write_text(json.dumps(record, indent=1) + "\n")
            made.append(out / "manifest.json")
        made = [args.out / path.name for path in made]
    except PlaitError as e:
        exit_bad_input(e)
    for path in made:
        log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
