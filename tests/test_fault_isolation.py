"""A failure while one request is processed fails that request alone (finish reason "error")
and the engine serves on; a failed forward pass fails its step's requests and gives every
block back, with no block left named for tokens that were never computed."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import running_server
from fulcrum import LLM, SamplingParams
from fulcrum.core.request import RequestStatus
from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.detokenizer import IncrementalDetokenizer
from fulcrum.output_processor import OutputProcessor
from fulcrum.outputs import RequestFault
from fulcrum.worker.sampler import Sampler
from test_bad_input import assert_all_blocks_free, run_to_completion

PROMPTS = {"a": list(range(1, 30)), "b": [5, 6, 7, 8, 9, 10], "c": list(range(40, 75))}
POISON = "poison"  # the request id whose processing the tests break


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture
def llm(llama_dir):
    # fcfs: which step each request runs in must not depend on measured step times (under
    # slo, a loaded machine can push the poisoned request's second child to a later step)
    return LLM(str(llama_dir), block_size=4, max_num_batched_tokens=64,
               scheduling_policy="fcfs")


def reference(llm: LLM) -> dict:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS.values()], greedy(),
                           use_tqdm=False)
    return {rid: o.outputs[0].token_ids for rid, o in zip(PROMPTS, outputs)}


def run_with_poison(llm: LLM) -> dict:
    """Run the good requests with the poisoned one among them; the final outputs by id."""
    engine = llm.llm_engine
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, greedy())
    engine.add_request(POISON, {"prompt_token_ids": [3, 1, 4, 1, 5]}, greedy(n=2))
    _, final = run_to_completion(engine)
    assert_all_blocks_free(engine)
    return final


def assert_only_poison_failed(final: dict, expected: dict, what: str) -> None:
    failed = final[POISON]
    assert failed.finished and failed.error is not None and what in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    for request_id, tokens in expected.items():
        assert final[request_id].error is None
        assert final[request_id].outputs[0].token_ids == tokens
        assert final[request_id].outputs[0].finish_reason == "length"


def test_sampler_fault_fails_one_request(llm, monkeypatch):
    expected = reference(llm)
    original = Sampler.__call__

    def sample(self, logits, rows):
        # The poisoned request's rows fail from its second token on.
        if any(POISON in r.request_id and len(r.all_token_ids) > r.num_prompt_tokens
               for r in rows):
            raise RuntimeError("injected fault")
        return original(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", sample)
    final = run_with_poison(llm)
    assert_only_poison_failed(final, expected, "sampling failed")
    assert not isinstance(final[POISON].error, RequestFault)  # the engine's doing: a 500
    # Each child sampled one token before the fault; the error output keeps it.
    assert [len(c.token_ids) for c in final[POISON].outputs] == [1, 1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_that_rules_out_every_token_fails_alone(llm, temperature):
    """Its regular expression matches no text, so its grammar masks every token: no token
    has a finite logit. Greedy argmax would pick a masked token and sampling one past the
    vocabulary, which failed the next forward pass and with it every request of the step."""
    expected = reference(llm)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    (alone,) = llm.generate([{"prompt_token_ids": [9, 8, 7]}], seeded, use_tqdm=False)
    engine = llm.llm_engine
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, greedy())
    # A seeded request beside it keeps its tokens: the batch is not drawn twice.
    engine.add_request("seeded", {"prompt_token_ids": [9, 8, 7]}, seeded)
    engine.add_request(POISON, {"prompt_token_ids": [3, 1, 4, 1, 5]}, SamplingParams(
        temperature=temperature, max_tokens=4, seed=0,
        structured_outputs=StructuredOutputsParams(regex="[^\\s\\S]")))
    _, final = run_to_completion(engine)
    assert_all_blocks_free(engine)
    failed = final[POISON]
    assert isinstance(failed.error, RequestFault)  # the request's doing: a server says 400
    assert "no token can be sampled" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    assert failed.outputs[0].token_ids == []
    for request_id, tokens in {**expected, "seeded": alone.outputs[0].token_ids}.items():
        assert final[request_id].error is None
        assert final[request_id].outputs[0].token_ids == tokens


def test_detokenizer_fault_fails_one_request(llm, monkeypatch):
    expected = reference(llm)
    original = IncrementalDetokenizer.update

    def update(self, new_token_ids, check_stop=True, final=False):
        if self.params.seed == 1234:  # only the poisoned request has this seed
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return original(self, new_token_ids, check_stop, final)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    engine = llm.llm_engine
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, greedy())
    engine.add_request(POISON, {"prompt_token_ids": [3, 1, 4]}, greedy(seed=1234))
    _, final = run_to_completion(engine)
    assert_all_blocks_free(engine)
    assert "processing the output failed" in final[POISON].error
    assert final[POISON].outputs[0].finish_reason == "error"
    for request_id, tokens in expected.items():
        assert final[request_id].outputs[0].token_ids == tokens


def test_output_building_fault_fails_one_request(llm, monkeypatch):
    expected = reference(llm)
    original = OutputProcessor._parent_output

    def parent_output(self, parent, touched, finished):
        if parent.request_id == POISON:
            raise KeyError("injected fault")
        return original(self, parent, touched, finished)

    monkeypatch.setattr(OutputProcessor, "_parent_output", parent_output)
    final = run_with_poison(llm)
    assert_only_poison_failed(final, expected, "building the output failed")
    assert [c.token_ids for c in final[POISON].outputs] == [[], []]


def test_failed_forward_fails_its_step_and_leaves_no_uncomputed_named_block(llm, monkeypatch):
    expected = reference(llm)
    engine = llm.llm_engine
    engine.block_manager.reset_prefix_cache()
    runner = engine.runner
    original = runner.model.forward
    state = {"calls": 0}

    def forward(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == 2:  # the second step: prompts part-way through their prefill
            raise RuntimeError("injected forward failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", forward)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, greedy())
    # The failing step's requests fail; blocks named for it were never written.
    _, final = run_to_completion(engine)
    assert_all_blocks_free(engine)
    failed = [rid for rid, out in final.items() if out.error is not None]
    assert failed and all("the forward pass failed" in final[r].error for r in failed)
    assert all(final[r].outputs[0].finish_reason == "error" for r in failed)
    manager = engine.block_manager
    # Every named block was computed: a second run hitting them gives the reference tokens.
    monkeypatch.setattr(runner.model, "forward", original)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS.values()], greedy(),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == list(expected.values())
    assert any(o.num_cached_tokens > 0 for o in outputs)
    manager.check_invariants()


# ------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(llama_dir, num_gpu_blocks_override=256) as pair:
        yield pair


def test_server_fails_one_request_and_serves_the_others(server, monkeypatch):
    background, async_llm = server
    original = Sampler.__call__

    def sample(self, logits, rows):
        if any(r.params.seed == 99 for r in rows):
            raise RuntimeError("injected fault")
        return original(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", sample)
    url = background.url + "/v1/completions"
    bad = {"prompt": "poison", "max_tokens": 5, "seed": 99, "temperature": 0.5}
    good = {"prompt": "fine", "max_tokens": 5, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        response = client.post(url, json=bad)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == 500 and "sampling failed" in error["message"]
        with client.stream("POST", url, json={**bad, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "sampling failed" in json.loads(events[-2])["error"]["message"]
        assert client.get(background.url + "/health").status_code == 200
        ok = client.post(url, json=good).json()
        assert ok["usage"]["completion_tokens"] == 5
    manager = async_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_a_request_failed_before_its_token_is_processed_has_no_stop_reason(stories_dir,
                                                                            monkeypatch):
    """A request the step already failed (a sibling's or its grammar's fault) keeps finish
    reason "error", with no stop string, even when the token it sampled completes one."""
    llm = LLM(str(stories_dir))
    engine = llm.llm_engine
    processor = engine.output_processor
    process = processor.process_tokens
    steps = []

    def fail_first(sampled):
        steps.append(1)
        if len(steps) == 3:  # the step whose token completes " was" (", there was")
            for child_id in sampled:
                for request in processor.siblings(child_id):
                    request.error = "failed by the test"
                    engine.scheduler.finish_requests([request.request_id],
                                                     RequestStatus.FINISHED_ERROR)
        return process(sampled)

    monkeypatch.setattr(processor, "process_tokens", fail_first)
    (output,) = llm.generate("Once upon a time", SamplingParams(
        temperature=0.0, max_tokens=8, stop=[" was"]), use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 3
    assert (completion.finish_reason, completion.stop_reason) == ("error", None)
    assert_all_blocks_free(engine)
