"""`fulcrum demo` runs its three modes on a small schedule and reports each."""

from __future__ import annotations

from fulcrum.cli import main


def test_demo_runs_the_three_modes(llama_dir, capsys, one_torch_thread):
    code = main(["demo", str(llama_dir), "--long-len", "300", "--num-short", "3",
                 "--short-len", "8", "--output-len", "4", "--interval", "0.01",
                 "--chunk-budget", "64"])
    out = capsys.readouterr().out
    assert code == 0
    for label in ("slo (default): chunks sized to latency targets",
                  "fcfs: fixed chunks of 8 tokens", "no chunked prefill"):
        assert out.count(label) == 2  # its section and its summary row
    assert out.count("short-02  TTFT") == 3 and out.count("long      TTFT") == 3
    assert "slo vs no chunking: short requests' median TTFT" in out


def test_demo_serves_its_dashboard(llama_dir, one_torch_thread, monkeypatch):
    """With --dashboard, the page's data follows each mode's engine while it runs."""
    import httpx

    from fulcrum import demo

    seen, urls = [], []
    original = demo.run_schedule

    def watched(engine, arrivals):
        result = original(engine, arrivals)
        if len(arrivals) > 1:  # the timed run, not the warm-up
            state = httpx.get(urls[0] + "dashboard/state").json()
            seen.append((state["config"]["policy"], len(state["steps"]) > 0))
        return result

    real_print = print

    def capture(*args, **kwargs):
        text = " ".join(map(str, args))
        if text.startswith("Dashboard: "):
            urls.append(text.split()[1])
        real_print(*args, **kwargs)

    monkeypatch.setattr(demo, "run_schedule", watched)
    monkeypatch.setattr(demo, "DASHBOARD_PAUSE_S", 0.0)
    monkeypatch.setitem(demo.__dict__, "print", capture)
    code = main(["demo", str(llama_dir), "--long-len", "100", "--num-short", "2",
                 "--short-len", "8", "--output-len", "2", "--interval", "0.01",
                 "--chunk-budget", "64", "--dashboard", "0"])
    assert code == 0 and urls and urls[0].endswith("/")
    assert seen == [("slo", True), ("fcfs", True), ("fcfs", True)]


def test_the_demos_summary_says_higher_when_chunking_loses():
    from fulcrum.demo import short_ttft_change

    assert short_ttft_change({"short_median": 0.1}, {"short_median": 0.25}) == "2.5x lower"
    assert short_ttft_change({"short_median": 0.25}, {"short_median": 0.1}) == "2.5x higher"


def test_the_demo_sets_the_chunking_itself(capsys):
    """Its modes choose chunked prefill or not; a threshold would make its third mode (no
    chunking) refuse to start after the first two had run."""
    import pytest

    for flag in ("--long-prefill-token-threshold", "--max-num-partial-prefills"):
        with pytest.raises(SystemExit):
            main(["demo", flag, "2"])
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
