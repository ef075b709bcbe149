"""`fulcrum bench report --quick`: one real fulcrum server on the tiny model, the three
workloads through the streaming client, and the page and JSON it writes (loopback only)."""

from __future__ import annotations

import json

from fulcrum.bench.report import COLUMNS
from fulcrum.cli import main


def test_report_quick_writes_three_tables_and_json(llama_dir, tmp_path):
    out = tmp_path / "performance.md"
    code = main(["bench", "report", "--quick", "--engines", "fulcrum,fulcrum-int8", "--repeats",
                 "1", "--model", str(llama_dir), "--out", str(out)])
    assert code == 0
    page = out.read_text()
    for workload, columns in COLUMNS.items():
        assert f"## {workload.capitalize()}" in page
        assert "| engine | " + " | ".join(h for h, _ in columns) + " |" in page
    for engine in ("fulcrum", "fulcrum-int8"):  # three tables + the engines table
        assert page.count(f"\n| {engine} | ") == 3 + 1
    assert "| fulcrum serve --quantization int8 (" in page
    assert " | bfloat16, int8 linear layers |" in page
    assert "fulcrum bench report --out" in page and "vLLM" in page
    data = json.loads(out.with_suffix(".json").read_text())
    for engine in ("fulcrum", "fulcrum-int8"):
        results = data["results"][engine]
        assert set(results) == set(COLUMNS)
        assert results["throughput"]["median"]["total tokens/s"] > 0
        assert results["decode"]["median"]["TPOT median (ms)"] > 0
        assert results["mixed"]["median"]["long TTFT (ms)"] > 0
        assert results["mixed"]["runs"][0]["reports"]["all"]["failed"] == 0


def test_render_only_rewrites_the_page_with_the_goodput_section(tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    from fulcrum.bench import report

    docs = Path(report.REPO) / "docs"
    out = tmp_path / "performance.md"
    shutil.copy(docs / "performance.json", out.with_suffix(".json"))
    goodput = {
        "setup": {"traffic": "30 chat-like requests per rate", "rates": [0.5, 2.0],
                  "slo": {"ttft": 1000.0, "tpot": 100.0}, "machine": {"date": "today"}},
        "best_fixed_budget": "fulcrum-fcfs-512",
        "results": {"fulcrum-slo": {"points": [{"goodput_share": 1.0}, {"goodput_share": 0.5}]},
                    "vllm": {"error": "did not start"}}}
    (tmp_path / "goodput").mkdir()
    (tmp_path / "goodput" / "goodput.json").write_text(json.dumps(goodput))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    assert main(["bench", "report", "--render-only", "--out", str(out)]) == 0
    page = out.read_text()
    assert "## Throughput" in page and "## Mixed" in page
    assert "## Goodput against offered load" in page
    assert "| engine | 0.5 req/s | 2 req/s |" in page
    assert "| fulcrum-slo | 100% | 50% |" in page
    assert "| vllm |" not in page.split("## Goodput")[1]  # a failed engine has no row
    assert "best of the sweep: fulcrum-fcfs-512" in page
    assert "![goodput](goodput/goodput.png)" in page
    # A page of another kind of machine reads only the folders with its suffix.
    data = json.loads(out.with_suffix(".json").read_text())
    data["setup"]["results_suffix"] = "-avx2"
    out.with_suffix(".json").write_text(json.dumps(data))
    assert main(["bench", "report", "--render-only", "--out", str(out)]) == 0
    assert "## Goodput" not in out.read_text()
    (tmp_path / "goodput-avx2").mkdir()
    (tmp_path / "goodput-avx2" / "goodput.json").write_text(json.dumps(goodput))
    assert main(["bench", "report", "--render-only", "--out", str(out)]) == 0
    assert "![goodput](goodput-avx2/goodput.png)" in out.read_text()


def test_engines_take_turns_in_rounds_and_a_failed_engine_drops_out(monkeypatch):
    """Round r runs the r-th workloads on every engine before round r + 1 starts, so a slow
    spell of the machine falls on all engines; an engine that fails once is not started
    again."""
    from contextlib import contextmanager

    from fulcrum.bench import report

    started = []

    @contextmanager
    def fake_server(command, port):
        engine = command[-1]
        started.append(engine)
        if engine == "vllm" and started.count("vllm") == 1:
            raise RuntimeError("vllm did not start")
        yield engine

    def fake_run(engine, load):
        return {"throughput": {"metrics": {"total tokens/s": load["throughput"]}}}

    monkeypatch.setattr(report, "server_command", lambda engine, *args: [engine])
    monkeypatch.setattr(report, "running_server", fake_server)
    monkeypatch.setattr(report, "serve_run", fake_run)
    timed = [{"throughput": 10.0}, {"throughput": 20.0}, {"throughput": 30.0}]
    runs = report._rounds(["fulcrum", "vllm", "fulcrum-int8"], timed, "model", True, 512)
    assert started == ["fulcrum", "vllm", "fulcrum-int8", "fulcrum", "fulcrum-int8",
                       "fulcrum", "fulcrum-int8"]
    assert runs["vllm"] == {"error": "vllm did not start"}
    for engine in ("fulcrum", "fulcrum-int8"):
        assert [r["metrics"]["total tokens/s"] for r in runs[engine]["throughput"]] == [
            10.0, 20.0, 30.0]


def test_the_regenerate_command_repeats_the_run_and_parses_again():
    import argparse
    import shlex

    from fulcrum.bench import report

    parser = argparse.ArgumentParser()
    report.add_report_args(parser)
    args = parser.parse_args(["--out", "docs/performance-avx2.md", "--engines", "fulcrum,vllm",
                              "--results-suffix=-avx2"])
    command = report.command_line(args)
    assert command == ("fulcrum bench report --out docs/performance-avx2.md --repeats 3 "
                       "--engines fulcrum,vllm --results-suffix=-avx2")
    assert parser.parse_args(shlex.split(command)[3:]) == args


def test_llama_cpp_rows_and_ratios_render_from_its_results(tmp_path):
    """A llama.cpp engine gets its row in the engines table and a fulcrum / llama.cpp row
    under every table, each cell fulcrum's median over llama.cpp's."""
    import copy
    from pathlib import Path

    from fulcrum.bench import report

    data = json.loads((Path(report.REPO) / "docs" / "performance-avx2.json").read_text())
    fulcrum = data["results"]["fulcrum"]
    peer = copy.deepcopy(fulcrum)
    for cell in peer.values():
        cell["median"] = {h: 2 * v for h, v in cell["median"].items() if v is not None}
    data["results"] = {"fulcrum": fulcrum, "llamacpp": peer}
    data["setup"]["llama_cpp_version"] = "vendored in llama-cpp-python 0.3.36"
    page = report.render(data, tmp_path / "performance.md")
    assert "| llamacpp | llama.cpp's llama-server (" in page and " | bfloat16 |" in page
    assert ", llama.cpp vendored in llama-cpp-python 0.3.36" in page
    assert "fulcrum / llama.cpp" in page.split("## Model and engines")[1].split("## ")[0]
    for workload, columns in COLUMNS.items():
        table = page.split(f"## {workload.capitalize()}")[1].split("\n\n")[1]
        assert table.splitlines()[-1] == "| **fulcrum / llama.cpp** | " + " | ".join(
            "0.50x" for _ in columns) + " |"


def test_peers_not_installed_drop_out_with_a_note(tmp_path, monkeypatch):
    from fulcrum.bench import report

    monkeypatch.setattr(report, "LLAMA_CPP_DIR", tmp_path)
    monkeypatch.setattr(report, "vllm_version", lambda: "0.32.0")
    engines, peers = report._installed_peers(["fulcrum", "vllm", "llamacpp", "llamacpp-q8"])
    assert engines == ["fulcrum", "vllm"]
    assert peers["vllm_version"] == "0.32.0" and peers["vllm_note"] is None
    assert peers["llama_cpp_version"] is None
    assert f"its server is not built in {tmp_path}" in peers["llama_cpp_note"]
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "bin" / "llama-server").touch()
    (tmp_path / "version").write_text("vendored in llama-cpp-python 0.3.36\n")
    engines, peers = report._installed_peers(["fulcrum", "llamacpp-q8"])
    assert engines == ["fulcrum", "llamacpp-q8"] and peers["llama_cpp_note"] is None
    assert peers["llama_cpp_version"] == "vendored in llama-cpp-python 0.3.36"
    assert peers["vllm_version"] is None  # not asked for: not named on the page


def test_results_name_gives_the_stem_the_exact_command_and_the_scripts_own_options(
        monkeypatch):
    """A benchmark script's results file, and the command its page quotes to regenerate it:
    what was typed, the script's own options included."""
    from fulcrum.bench.report import results_name

    def options(parser):
        parser.add_argument("--base", required=True)

    monkeypatch.setattr("sys.argv", ["x.py", "--base", "HEAD~1", "--name", "x-avx2"])
    stem, command, args = results_name("x.py", "Doc.\n\nMore.", "x", options)
    assert (stem, args.base) == ("x-avx2", "HEAD~1")
    assert command == "python benchmarks/x.py --base 'HEAD~1' --name x-avx2"
    monkeypatch.setattr("sys.argv", ["x.py"])
    assert results_name("x.py", "Doc.", "x")[:2] == ("x", "python benchmarks/x.py")
