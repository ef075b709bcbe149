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
