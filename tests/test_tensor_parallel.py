"""Tensor parallelism: every architecture's greedy tokens at TP=2 (and TP=4, with KV heads
replicated) equal TP=1's in float32; the per-step messages; a rank that dies stops the
engine with an error instead of hanging."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import threading
import time

import httpx
import pytest
import torch
from conftest import running_server

from fulcrum import LLM, SamplingParams
from fulcrum.executor import ExecutorError
from fulcrum.models.sharding import Shard
from fulcrum.models.spec import DecoderSpec
from fulcrum.core.scheduler import ScheduledChunk, SchedulerOutput
from fulcrum.worker.worker import StepInputBuilder

pytestmark = pytest.mark.timeout(300)  # a rank out of step must fail, not hang

# A long prompt split into chunks beside short ones, with a shared prefix (prefix cache).
PROMPTS = [list(range(3, 140)), [5, 6, 7, 8], list(range(3, 40)) + [9, 9], [300, 2, 77]]
KW = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 20,
          max_num_batched_tokens=64, scheduling_policy="fcfs", enable_prefix_caching=True)


def _generate(llm: LLM, logprobs: int = 0):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            logprobs=logprobs or None, prompt_logprobs=logprobs or None)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def _same_logprobs(expected, got) -> None:
    for a, b in zip(expected, got):
        if a is None:
            assert b is None
            continue
        assert set(a) == set(b)
        for token in a:
            assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)


def _check_same(model_dir, tp: int, **extra) -> None:
    settings = {**KW, **extra}
    single = _generate(LLM(str(model_dir), **{k: v for k, v in settings.items()
                                              if k != "distributed_executor_backend"}),
                       logprobs=2)
    split = LLM(str(model_dir), tensor_parallel_size=tp, **settings)
    try:
        assert split.llm_engine.executor.group.world_size == tp
        parallel = _generate(split, logprobs=2)
        for one, many in zip(single, parallel):
            assert many.outputs[0].token_ids == one.outputs[0].token_ids
            _same_logprobs(one.outputs[0].logprobs, many.outputs[0].logprobs)
            _same_logprobs(one.prompt_logprobs, many.prompt_logprobs)
        assert split.llm_engine.block_manager.num_free_blocks == \
            split.llm_engine.block_manager.num_blocks - 1  # nothing leaked
    finally:
        split.llm_engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tp2_tokens_equal_tp1(model_dirs, arch):
    _check_same(model_dirs[arch], 2)


def test_tp2_stories260k_equals_tp1(stories_dir):
    _check_same(stories_dir, 2)


def test_tp2_under_preemption_equals_tp1(model_dirs):
    # 20 blocks of 16 tokens for ~250 tokens of context at once: requests are preempted and
    # resume with new blocks, which the other rank must learn of (its tables start over).
    _check_same(model_dirs["llama"], 2, num_gpu_blocks_override=20, kv_cache_memory_bytes=None,
                enable_prefix_caching=False)


def test_tp2_prompt_logprobs_when_a_preempted_prompt_comes_back_in_larger_chunks(stories_dir):
    """The recomputed chunk's prompt-logprob rows start past its first position: the other
    rank must compute the LM head on the same rows (it would wait or fail otherwise)."""
    settings = dict(max_model_len=512, num_gpu_blocks_override=33, block_size=16,
                    scheduling_policy="fcfs", max_num_batched_tokens=64,
                    long_prefill_token_threshold=64, enable_prefix_caching=False)
    a = {"prompt_token_ids": [1] + [(7 * i) % 500 + 3 for i in range(399)]}
    b = {"prompt_token_ids": [1] + [(11 * i) % 500 + 3 for i in range(119)]}
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1)
    alone = LLM(str(stories_dir), **settings).generate([b], params, use_tqdm=False)[0]
    split = LLM(str(stories_dir), tensor_parallel_size=2, **settings)
    try:
        _, beside = split.generate([a, b], [SamplingParams(temperature=0, max_tokens=60,
                                                           ignore_eos=True), params],
                                   use_tqdm=False)
        assert beside.metrics.num_preemptions > 0 and len(beside.prompt_logprobs) == 120
        _same_logprobs(alone.prompt_logprobs, beside.prompt_logprobs)
    finally:
        split.llm_engine.shutdown()


def test_tp4_replicates_kv_heads(model_dirs):
    # 4 query heads, 2 KV heads: each KV head is held by two ranks.
    _check_same(model_dirs["qwen2"], 4)


# The native kernels' shape: 64-wide heads (the tiny test models have 16).
WIDE_HEADS = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 320,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "bos_token_id": 256, "eos_token_id": 258}


def test_tp2_bf16_native_stack_equals_the_python_layers(tmp_path):
    # The native stack reduces between its layers through the same shared-memory protocol
    # as the Python layers, so rank 0 may run either while rank 1 runs the native stack.
    from fulcrum.default_model import ensure_config_folder

    folder = ensure_config_folder(tmp_path / "wide", WIDE_HEADS)
    llm = LLM(folder, tensor_parallel_size=2, load_format="dummy",
              **{**KW, "dtype": "bfloat16"})
    try:
        model = llm.llm_engine.runner.model.model
        if model.native is None:
            pytest.skip("no native kernels on this CPU")
        native = [o.outputs[0].token_ids for o in _generate(llm)]
        model.native = None
        python = [o.outputs[0].token_ids for o in _generate(llm)]
        assert native == python and all(len(t) == 12 for t in native)
    finally:
        llm.llm_engine.shutdown()


@contextlib.contextmanager
def _rank_killed_mid_run(folder, signal_=signal.SIGKILL, **kw):
    """An engine at TP=2, one step into a request, whose rank 1 has just been sent
    `signal_` (SIGKILL: it ends; SIGSTOP: it stops answering, alive)."""
    llm = LLM(str(folder), tensor_parallel_size=2, **{**KW, **kw})
    engine = llm.llm_engine
    process = engine.executor._procs[0]
    try:
        engine.add_request("a", {"prompt_token_ids": PROMPTS[1]},
                           SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(process.pid, signal_)
        if signal_ == signal.SIGKILL:
            process.join(10)
        yield engine
    finally:
        if signal_ != signal.SIGKILL:
            process.kill()
        engine.shutdown()


def test_a_dead_rank_fails_the_engine_not_hangs(model_dirs):
    with _rank_killed_mid_run(model_dirs["llama"]) as engine:
        with pytest.raises(ExecutorError, match=r"rank 1 \(exit code -9\) stopped"):
            engine.step()
        with pytest.raises(ExecutorError, match="stopped"):
            engine.step()


def test_the_error_a_rank_failed_with_reaches_the_driver(model_dirs):
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, **KW)
    engine = llm.llm_engine
    try:
        engine.executor.group.broadcast_object("not a step")  # rank 1 fails to follow it
        engine.executor._procs[0].join(30)
        with pytest.raises(ExecutorError, match=r"rank 1 \(exit code 1: AttributeError: 'str' "
                                                r"object has no attribute 'apply_to'\) stopped"):
            engine.add_request("a", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=2))
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("path", ["python", "native"])
def test_a_rank_dying_mid_step_fails_the_step_at_once(model_dirs, tmp_path, path):
    # As if it died after the driver's check before the step: the driver meets it in a
    # collective, in Python's shared-memory waits (float32) or the native stack's (bf16),
    # and must learn that it ended rather than wait out the collectives' 60 s.
    from fulcrum.default_model import ensure_config_folder

    folder, kw = model_dirs["llama"], {}
    if path == "native":
        folder = ensure_config_folder(tmp_path / "wide", WIDE_HEADS)
        kw = {"dtype": "bfloat16", "load_format": "dummy"}
    with _rank_killed_mid_run(folder, **kw) as engine:
        if path == "native" and engine.runner.model.model.native is None:
            pytest.skip("no native kernels on this CPU")
        calls, real = [], engine.executor._dead_ranks
        # The check before the step misses it; later ones see it.
        engine.executor._dead_ranks = lambda: real() if calls.append(1) or len(calls) > 1 else ""
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"rank 1 \(exit code -9\) stopped during a step"):
            engine.step()
        assert time.monotonic() - start < 10


def test_a_rank_that_stops_answering_fails_the_step_within_the_timeout(model_dirs, monkeypatch):
    from fulcrum.distributed import shm

    monkeypatch.setattr(shm, "COLLECTIVE_TIMEOUT_S", 2.0)
    with _rank_killed_mid_run(model_dirs["llama"], signal.SIGSTOP) as engine:
        start = time.monotonic()
        with pytest.raises(ExecutorError, match="did not reach a collective within 2 s"):
            engine.step()
        assert time.monotonic() - start < 30


def test_aborting_a_group_aborts_its_device_collectives_not_its_gloo_group():
    """On CUDA the step's collectives run on NCCL, whose kernels wait on the GPU for a lost
    peer until the communicator is aborted; gloo fails by itself when a peer's sockets close.
    (The NCCL path itself needs a GPU: this checks which groups the abort reaches.)"""
    from fulcrum.distributed.group import ParallelGroup

    class Backend:
        aborted = False

        def abort(self):
            self.aborted = True

    group = ParallelGroup.__new__(ParallelGroup)
    group.shm, group.cpu = None, Backend()
    group.pg = group.cpu
    group.abort()
    assert not group.cpu.aborted
    group.pg = Backend()
    group.abort()
    assert group.pg.aborted and not group.cpu.aborted


def test_a_rank_dying_while_starting_fails_the_engine_at_once(model_dirs):
    # Killed while it imports torch, before it joins the group: the driver's wait to meet
    # it (gloo's rendezvous would wait 600 s) must end with the rank's fate.
    def kill_the_first_rank():
        deadline = time.monotonic() + 60
        while not multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.005)
        for child in multiprocessing.active_children():
            child.kill()

    killer = threading.Thread(target=kill_the_first_rank, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"rank 1 \(exit code -9\) stopped while the engine "
                                            r"started"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=2, **KW)
    assert time.monotonic() - start < 60
    killer.join(10)


DRIVER_KILLED_SCRIPT = """
import os, signal, sys
from fulcrum import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 20)
    print("RANK", llm.llm_engine.executor._procs[0].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_ranks_end_when_their_driver_is_killed(model_dirs, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER_KILLED_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(model_dirs["llama"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pid = int(next(line for line in done.stdout.splitlines() if line.startswith("RANK "))[5:])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


ALIVE_AT_EXIT_SCRIPT = """
import sys, weakref
weakref.finalize(object, lambda: None)  # before multiprocessing is imported, as a TemporaryDirectory
from fulcrum import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 20)
    print("DONE", flush=True)
"""


def test_a_script_ending_with_an_llm_alive_exits_whatever_finalize_came_first(model_dirs,
                                                                              tmp_path):
    """With weakref.finalize's exit hook registered before multiprocessing's, the latter
    ran first: it sent the ranks a SIGTERM they ignore and joined them for good."""
    import subprocess
    import sys

    script = tmp_path / "alive.py"
    script.write_text(ALIVE_AT_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(model_dirs["llama"])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-2000:]


def test_an_llm_dropped_without_shutdown_ends_its_ranks_and_unpins_the_caller(model_dirs):
    """The group held the executor through its rank check, so `del llm` left the ranks
    running (with their share of model and cache) and the caller pinned to one core."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, **KW)
    _generate(llm)
    (process,) = llm.llm_engine.executor._procs
    del llm
    gc.collect()
    process.join(30)
    assert not process.is_alive()
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


@contextlib.contextmanager
def _ctrl_c_in_step(model_dir, step: int, presses: int, stall_s: float = 0.0):
    """(llm, steps run) at TP=2, with Ctrl-C pressed `presses` times while the driver runs
    its `step`-th step (after the first call: a reference), the step then taking `stall_s`
    more, as one stuck on a rank would."""
    llm = LLM(str(model_dir), tensor_parallel_size=2, **KW)
    runner = llm.llm_engine.executor.driver.runner
    execute, calls = runner.execute, []

    def interrupted(output):
        calls.append(1)
        if len(calls) == step:
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(stall_s)
        return execute(output)

    try:
        yield llm, calls, lambda: setattr(runner, "execute", interrupted), \
            lambda: setattr(runner, "execute", execute)
    finally:
        llm.llm_engine.shutdown()


def test_ctrl_c_during_a_step_lands_after_it_and_the_engine_goes_on(model_dirs):
    """An interrupt between the driver's collectives left the ranks a step apart: the next
    call waited 60 s, then the engine was dead for good (one process recovers)."""
    with _ctrl_c_in_step(model_dirs["llama"], step=3, presses=1) as (llm, calls, press, done):
        reference = _generate(llm)
        press()
        with pytest.raises(KeyboardInterrupt):
            _generate(llm)
        assert len(calls) == 3  # it came after the step it arrived in, not inside it
        done()
        start = time.monotonic()
        again = _generate(llm)
        assert time.monotonic() - start < 30
        assert [o.outputs[0].token_ids for o in again] == \
            [o.outputs[0].token_ids for o in reference]


def test_ranks_on_one_machine_share_the_kv_fraction_of_its_ram(model_dirs):
    """Each rank sized its cache from the same available RAM before any had allocated, so
    together they took the fraction asked for once per rank (a small machine's OOM killer)."""
    from fulcrum.worker.memory import available_cpu_memory

    asked = 8 << 20  # bytes in all, far below what max_num_seqs requests could ever use
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, dtype="float32",
              gpu_memory_utilization=asked / available_cpu_memory())
    try:
        per_block = 2 * 2 * 16 * 1 * 16 * 4  # K and V, layers, block size, a KV head, fp32
        in_all = 2 * llm.llm_engine.executor.num_blocks * per_block
        assert asked * 0.75 < in_all < asked * 1.25
    finally:
        llm.llm_engine.shutdown()


def test_signals_for_the_whole_group_leave_the_ranks_to_the_driver(model_dirs):
    """A terminal sends Ctrl-C to its whole foreground process group, and systemd's stop
    SIGTERM to every process of the service, the ranks included: a rank either ended
    stopped the engine for good (a server exited 1 instead of draining). The driver still
    ends them at shutdown."""
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, **KW)
    (process,) = llm.llm_engine.executor._procs
    try:
        reference = _generate(llm)
        for signum in (signal.SIGINT, signal.SIGTERM):
            os.kill(process.pid, signum)
            process.join(2)
            assert process.is_alive()
            again = _generate(llm)
            assert [o.outputs[0].token_ids for o in again] == \
                [o.outputs[0].token_ids for o in reference]
    finally:
        llm.llm_engine.shutdown()
    process.join(30)
    assert not process.is_alive()


def test_a_second_ctrl_c_interrupts_a_stuck_step_and_stops_the_engine(model_dirs):
    """A step waiting on a rank that hangs (up to the 60 s collective timeout) must still
    yield to the user: the second Ctrl-C lands at once, and the ranks being out of step,
    later calls fail at once rather than wait."""
    with _ctrl_c_in_step(model_dirs["llama"], step=2, presses=2, stall_s=5) as (
            llm, _, press, done):
        press()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            _generate(llm)
        assert time.monotonic() - start < 4
        done()
        with pytest.raises(ExecutorError, match="stopped after a failure: KeyboardInterrupt"):
            _generate(llm)


def test_a_held_ctrl_c_goes_to_the_callers_own_handler_and_an_ignored_one_stays_ignored():
    from fulcrum.executor.parallel import _interrupts_after_the_step

    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, _: calls.append(signum))
    try:
        with _interrupts_after_the_step():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert calls == []  # held through the step
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert calls == [signal.SIGINT] * 2  # a second one: both, at once
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _interrupts_after_the_step():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert calls == [signal.SIGINT] * 2 and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_last_driver_to_unpin_gives_the_process_its_own_cores_back():
    """Two engines alive at once, shut down in the order they started: the second saved the
    first's pin as "the process's", and restoring it left the caller on one core."""
    from fulcrum.distributed.launch import DriverPin, split_cores

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first = DriverPin([min(cores)])
    second = DriverPin([max(cores)])
    assert DriverPin.process_cores() == cores
    assert sorted(c for share in split_cores(len(cores)) for c in share) == sorted(cores)
    first.release()
    assert os.sched_getaffinity(0) == {max(cores)}  # the second is still pinned
    second.release()
    second.release()  # once only
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)


def test_a_rank_whose_process_is_ending_is_named():
    """A dying process's sentinel reads ready before it can be reaped, while is_alive()
    still says True: the error then named no rank."""
    from fulcrum.executor.multiproc import _Ranks

    reader, writer = multiprocessing.Pipe(duplex=False)
    words, said = multiprocessing.Pipe(duplex=False)
    writer.close()
    said.close()

    class Dying:
        sentinel, exitcode, joined = reader, -9, False

        def is_alive(self):
            return not self.joined

        def join(self, timeout=None):
            self.joined = True

    assert _Ranks([Dying()], [words]).dead() == "tensor-parallel rank 1 (exit code -9) stopped"


def test_a_failed_start_leaves_no_shared_memory_file():
    from fulcrum.distributed.shm import SharedMemoryCollectives, _shm_dir

    def names():
        return {n for n in os.listdir(_shm_dir()) if n.startswith("fulcrum-tp-")}

    before = names()

    def barrier():
        raise ConnectionError("a rank ended while the engine started")

    with pytest.raises(ConnectionError):
        SharedMemoryCollectives(0, 2, lambda path: path, barrier)
    assert names() == before


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_shard_checks_and_vocab_padding():
    spec = DecoderSpec(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=1, rms_norm_eps=1e-6,
                       rope_theta=1e4, rope_scaling=None, max_position_embeddings=8,
                       tie_word_embeddings=True, o_proj_bias=True)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        Shard(0, 3, spec)
    with pytest.raises(ValueError, match=r"MLP width \(6\)"):
        Shard(0, 4, spec)
    table = torch.arange(40.0).view(10, 4)
    last = Shard(1, 2, spec)
    assert last.vocab_range == (5, 10) and last.local_vocab == 5
    assert torch.equal(last.slice("model.embed_tokens.weight", table), table[5:])
    spec3 = DecoderSpec(**{**spec.__dict__, "intermediate_size": 4, "num_heads": 4})
    end = Shard(3, 4, spec3)  # 3 rows each: rows 9, then two rows of zeros
    assert end.local_vocab == 3
    assert torch.equal(end.slice("lm_head.weight", table),
                       torch.cat([table[9:], torch.zeros(2, 4)]))
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
    k = torch.arange(2.0).view(2, 1)
    assert [Shard(r, 4, spec3).slice("layers.0.self_attn.k_proj.weight", k).item()
            for r in range(4)] == [0.0, 0.0, 1.0, 1.0]
    bias = torch.ones(4)
    assert torch.equal(Shard(0, 4, spec3).slice("layers.0.self_attn.o_proj.bias", bias), bias)
    assert not Shard(2, 4, spec3).slice("layers.0.self_attn.o_proj.bias", bias).any()
    o = torch.arange(8.0).view(2, 4)
    assert torch.equal(Shard(1, 2, spec3).slice("layers.0.self_attn.o_proj.weight", o), o[:, 2:])


def _chunk(request_id, tokens, start, table):
    return ScheduledChunk(request_id, tokens, start, table, None)


def test_step_inputs_send_only_new_blocks():
    builder = StepInputBuilder()
    first = builder.build(SchedulerOutput([_chunk("a", [1, 2, 3], 0, [4, 5]),
                                           _chunk("b", [7], 9, [6])], 3, 1, [], []))
    # Decodes first (the runner's row order); every block is new.
    assert [(c.request_id, c.new_blocks) for c in first.chunks] == [("b", [6]), ("a", [4, 5])]
    second = builder.build(SchedulerOutput([_chunk("a", [8], 3, [4, 5, 9]),
                                            _chunk("b", [2], 10, [6])], 0, 2, [], []))
    assert [c.new_blocks for c in second.chunks] == [[9], []]
    # b is preempted: the ranks drop its table; when it runs again, it is sent whole.
    assert builder.build(SchedulerOutput([], 0, 0, ["b"], [])) is None
    third = builder.build(SchedulerOutput([_chunk("b", [7, 2], 0, [11])], 2, 0, [], ["a"]))
    assert third.dropped == ["b", "a"] and third.chunks[0].new_blocks == [11]
    tables = {"a": [4, 5, 9], "b": [6]}
    third.apply_to(tables)
    assert tables == {"b": [11]} and third.chunks[0].block_table == [11]


def test_tp2_on_ray_actors_equals_tp1(stories_dir):
    pytest.importorskip("ray")
    _check_same(stories_dir, 2, distributed_executor_backend="ray")


TORCHRUN_SCRIPT = """
import json, sys
from fulcrum import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="external_launcher",
          dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 20)
out = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in out]))
"""


@pytest.mark.parametrize("ending", ["llm.llm_engine.shutdown()", "del llm", ""])
def test_tp2_under_torchrun_equals_tp1(stories_dir, tmp_path, ending):
    """Rank 1 exits however rank 0's script ends: by shutting the engine down, by dropping
    it, or by just ending (it waited for ever, and torchrun with it)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "tp.py"
    script.write_text(TORCHRUN_SCRIPT + ending + "\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(script), str(stories_dir), json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1  # rank 0 alone returns from generate; rank 1 served it and exited
    single = _generate(LLM(str(stories_dir), **{**KW, "max_num_batched_tokens": None}))
    assert json.loads(lines[0][7:]) == [o.outputs[0].token_ids for o in single]


def _collectives_rank(rank: int, port: int, results) -> None:
    from fulcrum.distributed.group import connect

    group = connect(rank, 2, "127.0.0.1", port, torch.device("cpu"), host="127.0.0.1",
                    same_host=True)
    assert group.shm is not None
    sums = []
    for round_ in range(300):  # many rounds: the two alternating slots must never mix
        x = torch.full((5,), float(rank + round_ % 50), dtype=torch.bfloat16 if round_ % 2 else
                       torch.float32)
        sums.append(group.all_reduce(x)[0].item())
    gathered = group.all_gather(torch.full((2, 3), float(rank)))
    big = group.all_reduce(torch.ones(3 << 20))  # over the shared slot: gloo instead
    messages = [group.broadcast_object({"step": i} if rank == 0 else None) for i in range(5)]
    huge = group.broadcast_object(b"x" * (9 << 20) if rank == 0 else None)  # gloo's
    results.put((rank, sums, gathered.tolist(), big[0].item(), messages, len(huge)))


def test_shared_memory_collectives_across_processes():
    import multiprocessing

    from fulcrum.distributed.launch import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_collectives_rank, args=(rank, port, results))
             for rank in range(2)]
    for p in procs:
        p.start()
    got = dict((rank, rest) for rank, *rest in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    expected = [float(2 * (r % 50) + 1) for r in range(300)]
    for rank in range(2):
        sums, gathered, big, messages, huge = got[rank]
        assert sums == expected
        assert gathered == [[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]] * 2
        assert big == 2.0
        assert messages == [{"step": i} for i in range(5)] and huge == 9 << 20


def test_server_with_a_dead_rank_answers_errors_and_turns_unhealthy(model_dirs):
    with running_server(model_dirs["llama"], tensor_parallel_size=2, dtype="float32",
                        max_model_len=256, kv_cache_memory_bytes=1 << 20) as (server, llm):
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        process = llm.engine.executor._procs[0]
        process.kill()
        process.join(10)
        failed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert failed.status_code in (500, 503)
        assert "rank 1" in failed.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503


def test_under_torchrun_a_failed_step_sends_the_ranks_no_goodbye(monkeypatch):
    """After a step fails the other ranks may be part-way through it: the exit message the
    script's end would send must not reach them out of order (shutdown sends none either)."""
    import weakref

    from fulcrum.executor.parallel import ParallelExecutor
    from fulcrum.executor.torchrun import TorchrunExecutor

    sent = []
    executor = TorchrunExecutor.__new__(TorchrunExecutor)
    executor._farewell = weakref.finalize(executor, sent.append, "goodbye")

    def fail(self, output):
        raise RuntimeError("a collective failed")

    monkeypatch.setattr(ParallelExecutor, "execute", fail)
    with pytest.raises(RuntimeError, match="a collective failed"):
        executor.execute(None)
    del executor
    assert sent == []
