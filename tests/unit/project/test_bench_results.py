"""bench.results: a result's markdown tables become one row per figure, ``bench.common.report``
appends them with the command, device, date, versions and commit, and ``python -m bench.results``
prints them; docs/benchmarks.md's figures are rows of bench/results.jsonl."""

from __future__ import annotations

import json

from bench import common, results

BODY = """| save | writer | stall s | until written s |
|---|---|---|---|
| sync | DCP | 2.223 | 2.223 |
| async | DCP | 1.42 | 5,089 (page cache warm) |

flavor `50m`, 3 repeats."""


def test_each_figure_of_a_table_is_a_row_named_by_title_label_and_column():
    rows = results.figures("Checkpoint checksums", BODY)
    named = {r["name"]: (r["value"], r["unit"], r["note"]) for r in rows}
    assert named["Checkpoint checksums / sync, DCP / stall s"] == (2.223, "s", "")
    assert named["Checkpoint checksums / async, DCP / until written s"] == (5089.0, "s", "page cache warm")
    assert named["Checkpoint checksums"] == (None, "", "flavor `50m`, 3 repeats.")
    assert len(rows) == 5
    assert results.number("1.019x") == (1.019, "x", "") and results.number("not recorded") is None
    assert results.number("203.17-204.74") is None


def test_report_appends_its_figures_with_the_runs_facts_and_the_command_prints_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results.jsonl")
    monkeypatch.setattr(common.sys, "argv", ["bench/checkpoint_hash.py", "--flavor", "50m"])
    common.report("Checkpoint checksums: 50m on cpu", BODY, note="a loaded machine")
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [list(r) for r in rows] == [list(results.FIELDS)] * 5
    assert {r["command"] for r in rows} == {"python -m bench.checkpoint_hash --flavor 50m"}
    assert all(r["date"].endswith(" UTC") and r["versions"].startswith("torch ") for r in rows)
    assert rows[-1]["note"] == "a loaded machine; flavor `50m`, 3 repeats."
    capsys.readouterr()
    assert results.main(["--name", "/ sync, dcp /"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all("2.223" in line for line in out[2:])
    assert results.main(["--latest", "--name", "stall s"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4


def test_the_recorded_history_reads_and_holds_each_latest_figure_of_benchmarks_md():
    rows = results.read()
    assert rows and all(list(r) == list(results.FIELDS) for r in rows)
    values = {r["value"] for r in rows}
    for figure in (156.9, 0.9984, 0.4197, 26.98, 820.7, 884.8):  # docs/benchmarks.md's latest figures
        assert figure in values, figure
