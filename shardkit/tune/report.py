"""What people look at after a study: a table of trials (stdout and CSV) and the best trial as a
trainer `--config` TOML.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from shardkit.tune import tomlfile


def trial_rows(study) -> list[dict[str, Any]]:
    """One row per trial: number, state, objective, parameters, wall time, run directory."""
    names = sorted({name for trial in study.trials for name in trial.params})
    rows = []
    for trial in study.trials:
        row: dict[str, Any] = {"trial": trial.number, "state": trial.state.name,
                               "objective": trial.value if trial.value is not None else ""}
        row.update({name: trial.params.get(name, "") for name in names})
        row["wall_s"] = trial.user_attrs.get("wall_s", "")
        row["note"] = _note(trial)
        row["run_dir"] = trial.user_attrs.get("run_dir", "")
        rows.append(row)
    return rows


def _note(trial) -> str:
    attrs = trial.user_attrs
    if "pruned_at_step" in attrs:
        return f"pruned at step {attrs['pruned_at_step']}"
    if attrs.get("surplus"):
        return "not run: other tuners had started --trials trials"
    if attrs.get("interrupted"):
        return "interrupted (retried)"
    if "retry_of" in attrs:
        return f"retry of trial {attrs['retry_of']}"
    if "error" in attrs:
        return attrs["error"].splitlines()[0][:60]
    return ""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_table(rows: list[dict[str, Any]], *, columns: list[str] | None = None) -> str:
    """A plain fixed-width table (the run directory column is left to the CSV)."""
    if not rows:
        return "(no trials)"
    columns = columns or [c for c in rows[0] if c != "run_dir"]
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write the rows as CSV, atomically (never a truncated table)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["trial"])
    writer.writeheader()
    writer.writerows(rows)
    return tomlfile.write_text(path, text.getvalue())


def best_values(trainer_config: dict[str, Any]) -> dict[str, Any]:
    """The trial's trainer options without the ones that tie a run to the tuner's directories."""
    values = {k: dict(v) if isinstance(v, dict) else v for k, v in trainer_config.items()}
    for section, name in (("logging", "run_dir"), ("checkpoint", "checkpoint_dir"), ("checkpoint", "resume"),
                          ("data", "storage_options")):
        values.get(section, {}).pop(name, None)
    return values


def write_best(study, path: Path, *, objective: str) -> Path | None:
    """best.toml: the best complete trial's options; `python -m shardkit.train --config best.toml`
    repeats that trial (give it a fresh --run-dir). None when no trial completed."""
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if not complete:
        return None
    best = min(complete, key=lambda t: t.value)
    header = (f"best trial {best.number} of study {study.study_name!r}: {objective} {best.value!r}\n"
              f"parameters: {best.params}\n"
              "reproduce: python -m shardkit.train --config best.toml --run-dir NEW_DIR "
              "(add --storage-options if the data needs it)")
    return tomlfile.write(path, best_values(best.user_attrs["trainer_config"]), header=header)


def write_lineage(lineage: list[dict[str, Any]], names: list[str], directory: Path) -> None:
    """A PBT population's lineage.json (every event) and lineage.csv (one row per member and round, with the
    hyperparameters `names`), each written whole or not at all."""
    tomlfile.write_text(directory / "lineage.json", json.dumps(lineage, indent=1) + "\n")
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["round", "step", "member", *names, "score", "action", "source", "source_score",
                     *(f"new_{n}" for n in names), "trial", "run_dir", "resumed_from", "checkpoint"])
    for event in lineage:
        new = event.get("new_params", {})
        writer.writerow([event["round"], event["step"], event["member"],
                         *(event["params"][n] for n in names), event["score"], event["action"],
                         event.get("source", ""), event.get("source_score", ""),
                         *(new.get(n, "") for n in names),
                         *("" if event.get(k) is None else event[k]
                           for k in ("trial", "run_dir", "resumed_from", "checkpoint"))])
    tomlfile.write_text(directory / "lineage.csv", text.getvalue())
