"""`fulcrum bench report --quick`: one real fulcrum server on the tiny model, the three
workloads through the streaming client, and the page and JSON it writes (loopback only)."""

from __future__ import annotations

import json

from fulcrum.bench.report import COLUMNS
from fulcrum.cli import main


def test_report_quick_writes_three_tables_and_json(llama_dir, tmp_path):
    out = tmp_path / "performance.md"
    code = main(["bench", "report", "--quick", "--engines", "fulcrum", "--repeats", "1",
                 "--model", str(llama_dir), "--out", str(out)])
    assert code == 0
    page = out.read_text()
    for workload, columns in COLUMNS.items():
        assert f"## {workload.capitalize()}" in page
        assert "| engine | " + " | ".join(h for h, _ in columns) + " |" in page
    assert page.count("\n| fulcrum | ") == 3 + 1  # three tables + the engines table
    assert "fulcrum bench report --out" in page and "vLLM" in page
    data = json.loads(out.with_suffix(".json").read_text())
    fulcrum = data["results"]["fulcrum"]
    assert set(fulcrum) == set(COLUMNS)
    assert fulcrum["throughput"]["median"]["total tokens/s"] > 0
    assert fulcrum["decode"]["median"]["TPOT median (ms)"] > 0
    assert fulcrum["mixed"]["median"]["long TTFT (ms)"] > 0
    assert fulcrum["mixed"]["runs"][0]["reports"]["all"]["failed"] == 0
