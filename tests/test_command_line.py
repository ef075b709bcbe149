"""The commands' arguments are checked as they are parsed: a bad value is a usage error that
names its flag (exit 2), before any model loads or any run starts; what argparse cannot see
(the environment, files) fails with one line, not a traceback."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fulcrum.cli import build_parser, main


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "99999"], "argument --port: 99999 is not a TCP port (0-65535)"),
    (["serve", "--port", "-1"], "-1 is not a TCP port"),
    (["serve", "--port", "http"], "invalid port value: 'http'"),
    # A JSON string would be matched as a sequence of characters: a substring CORS check.
    (["serve", "--allowed-origins", '"https://good.example.com"'],
     "argument --allowed-origins: must be a JSON list of strings"),
    (["serve", "--allowed-origins", '{"a": 1}'], "--allowed-origins: must be a JSON list"),
    (["serve", "--allowed-methods", "5"], "--allowed-methods: must be a JSON list of strings"),
    (["serve", "--allowed-headers", "null"], "--allowed-headers: must be a JSON list"),
    (["serve", "--allowed-headers", "[1]"], "--allowed-headers: must be a JSON list"),
    (["serve", "--max-request-body-bytes", "0"], "must be a positive integer, got 0"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout: must be a finite number"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout: must be a finite number"),
    (["serve", "--max-log-len", "-1"], "--max-log-len: must be 0 or more, got -1"),
    (["serve", "--api-key", ""], "argument --api-key: must not be empty"),
    (["demo", "--interval", "nan"], "--interval: must be a finite number of seconds"),
    (["demo", "--interval", "inf"], "--interval: must be a finite number of seconds"),
    (["demo", "--num-short", "0"], "--num-short: must be a positive integer, got 0"),
    (["demo", "--dashboard", "99999"], "--dashboard: 99999 is not a TCP port"),
    (["bench", "throughput", "--num-prompts", "-1"], "--num-prompts: must be a positive"),
    (["bench", "throughput", "--input-len", "0"], "--input-len: must be a positive"),
    (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency: must be a positive"),
    (["bench", "serve", "--endpoint", "nope"], "--endpoint: must be a path that starts"),
    (["bench", "latency", "--batch-sizes", "4", "0"], "--batch-sizes: must be a positive"),
    (["bench", "scale", "--repeats", "0"], "--repeats: must be a positive integer"),
    (["bench", "throughput", "--save-result", "/"], "--save-result: / is a directory"),
    (["bench", "goodput", "--rates", "1,abc"], "--rates: must be positive request rates"),
    (["bench", "goodput", "--rates", "nan"], "--rates: must be positive request rates"),
    (["bench", "stress", "--read-timeout", "0"], "--read-timeout: must be more than 0 seconds"),
])
def test_a_bad_value_is_a_usage_error_naming_its_flag(argv, message, capsys):
    assert message in _usage_error(argv, capsys)


def test_good_values_parse(tmp_path):
    args = build_parser().parse_args([
        "serve", "--port", "0", "--allowed-origins", '["https://a.example"]',
        "--shutdown-timeout", "0", "--max-log-len", "0", "--api-key", "k"])
    assert (args.port, args.allowed_origins, args.shutdown_timeout, args.max_log_len,
            args.api_key) == (0, ["https://a.example"], 0.0, 0, ["k"])
    out = tmp_path / "new" / "result.json"  # a folder that does not exist yet is fine
    assert build_parser().parse_args(["bench", "throughput", "--save-result",
                                      str(out)]).save_result == str(out)


def test_an_api_key_variable_with_no_key_is_refused(monkeypatch, capsys):
    # "," would otherwise read as no keys at all: authentication off.
    monkeypatch.setenv("FULCRUM_API_KEY", " , ")
    assert main(["serve", "--no-web-ui"]) == 2
    assert "$FULCRUM_API_KEY is set but holds no key" in capsys.readouterr().err


def test_server_options_are_checked_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import socket

    import fulcrum.async_engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(fulcrum.async_engine.AsyncLLM, "from_engine_args", no_loading)
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    # As in vLLM: a value without braces or newlines is a path, and this one does not exist.
    missing = str(tmp_path / "template.jinja")
    assert main(["serve", "--chat-template", missing]) == 2
    assert "looks like a file's path, but there is no such file" in capsys.readouterr().err
    # The socket is bound first (as in vLLM): a port in use or a bad host fails at once.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--port", port]) == 2
        assert f"cannot listen on 127.0.0.1:{port} (--host, --port)" in capsys.readouterr().err
    assert main(["serve", "--host", "nohost.invalid"]) == 2
    assert "cannot listen on nohost.invalid:8000" in capsys.readouterr().err


def test_a_port_another_server_holds_while_its_model_loads_is_refused():
    """Bound but not yet listening, a port was taken a second time (SO_REUSEADDR): the
    second server loaded its model, then served nothing while it said it ran."""
    from fulcrum.server.api_server import listening_socket

    with listening_socket("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*in use"):
            listening_socket("127.0.0.1", port)


def test_serve_raises_the_open_file_limit():
    import resource

    from fulcrum.server.cli import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raise_open_file_limit()
        wanted = 65535 if hard == resource.RLIM_INFINITY else min(65535, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (wanted, hard)
        raise_open_file_limit(target=512)  # never lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == wanted
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_arrival_rate_and_burstiness_must_be_numbers():
    from fulcrum.bench.arrivals import arrival_offsets

    rng = np.random.default_rng(0)
    assert arrival_offsets(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]
    for rate, burstiness in [(math.nan, 1.0), (1.0, math.nan), (1.0, math.inf), (0.0, 1.0)]:
        with pytest.raises(ValueError, match="must be positive"):
            arrival_offsets(3, rate, burstiness, rng)


def test_request_logs_show_whatever_the_log_level(monkeypatch):
    import logging

    from fulcrum.server.cli import show_request_log

    logger = logging.getLogger("fulcrum.server.serving")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    show_request_log(build_parser().parse_args(["serve"]))
    assert logger.level == logging.NOTSET
    show_request_log(build_parser().parse_args(["--log-level", "ERROR", "serve",
                                                "--enable-log-requests"]))
    assert logger.isEnabledFor(logging.INFO)


def test_generate_refuses_latency_targets_no_policy_reads(capsys):
    assert main(["generate", "--prompt", "x", "--scheduling-policy", "fcfs",
                 "--slo-ttft-ms", "100"]) == 2
    assert capsys.readouterr().err == (
        "fulcrum generate: error: --slo-ttft-ms: latency targets steer only the slo scheduling "
        "policy, and generate shows no metrics, so under 'fcfs' they would change nothing (use "
        "'slo', or leave them out)\n")


def test_generate_starts_from_the_generation_config(llama_dir, tmp_path, capsys):
    from fulcrum import LLM

    folder = tmp_path / "gencfg"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        '{"max_new_tokens": 3, "temperature": 0.0, "repetition_penalty": 1.8}')
    argv = ["generate", str(llama_dir), "--prompt", "hi", "--generation-config", str(folder)]
    llm = LLM(str(llama_dir), generation_config=str(folder))
    defaults = llm.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.repetition_penalty) == (3, 1.8)
    assert main(argv) == 0
    text, summary = capsys.readouterr().out.rsplit("\n[", 1)
    assert text == llm.generate("hi", defaults, use_tqdm=False)[0].outputs[0].text
    assert ", 3 generated, finish_reason=length," in summary
    # A flag given overrides its field; the others stay the model's.
    assert main([*argv, "--max-tokens", "5"]) == 0
    text, summary = capsys.readouterr().out.rsplit("\n[", 1)
    longer = dataclasses.replace(defaults, max_tokens=5)
    assert text == llm.generate("hi", longer, use_tqdm=False)[0].outputs[0].text
    assert ", 5 generated, finish_reason=length," in summary


@pytest.mark.parametrize("flags, named", [
    (["--allowed-methods", '["GET"]'], "--allowed-methods"),
    (["--allowed-headers", '["x-custom"]', "--allow-credentials"],
     "--allowed-headers, --allow-credentials"),
])
def test_cors_flags_without_allowed_origins_are_refused(flags, named, capsys):
    # Before any model loads: the model folder need not exist.
    assert main(["serve", "/nonexistent", *flags]) == 2
    assert capsys.readouterr().err == (
        f"fulcrum serve: error: {named} shape CORS answers, which only --allowed-origins turns "
        'on (fulcrum sends none by default, unlike vLLM, whose default origins are ["*"]): '
        "give --allowed-origins too\n")


def test_serve_logs_at_info_and_the_other_commands_at_warning_by_default(tmp_path):
    """serve's periodic stats line and its KV cache line are INFO, as in vLLM, whose default
    level shows them; --log-level still decides where given."""
    from fulcrum.cli import log_level

    parser = build_parser()
    assert log_level(parser.parse_args(["serve", str(tmp_path)])) == "INFO"
    assert log_level(parser.parse_args(["generate", "--prompt", "x"])) == "WARNING"
    assert log_level(parser.parse_args(["--log-level", "ERROR", "serve", str(tmp_path)])) \
        == "ERROR"


def test_serves_info_level_is_fulcrums_own(tmp_path, monkeypatch):
    """Other libraries stay at WARNING: httpx would log each of the router's health probes."""
    import logging

    from fulcrum.cli import configure_logging

    fulcrum_logger = logging.getLogger("fulcrum")
    monkeypatch.setattr(fulcrum_logger, "level", fulcrum_logger.level)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # so that basicConfig acts
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)
    configure_logging(build_parser().parse_args(["serve", str(tmp_path)]))
    assert logging.getLogger("fulcrum.server.metrics").getEffectiveLevel() == logging.INFO
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING


def test_the_clis_copies_of_server_defaults_agree_with_the_server():
    """fulcrum.server.cli keeps copies so that parsing flags imports no server dependency."""
    from fulcrum.server import api_server, cli, http_protocol

    assert cli.DEFAULT_MAX_REQUEST_BODY_BYTES == api_server.DEFAULT_MAX_REQUEST_BODY_BYTES
    assert cli.DEFAULT_SHUTDOWN_TIMEOUT_S == api_server.DEFAULT_SHUTDOWN_TIMEOUT_S
    assert cli.DEFAULT_MAX_HEADER_BYTES == http_protocol.DEFAULT_MAX_HEADER_BYTES
