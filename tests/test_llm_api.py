"""The offline `LLM` API behaves as vLLM's: outputs in input order, every prompt form, one or
many SamplingParams, n > 1, chat templates, length and stop handling, priorities, tqdm."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import EOS_ID
from fulcrum import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), block_size=8)


def greedy(max_tokens=12, **kwargs):
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kwargs)


def ids(token_ids):
    return {"prompt_token_ids": list(token_ids)}


def tokens(output, i=0):
    return output.outputs[i].token_ids


def test_outputs_in_input_order(llm):
    # Later prompts finish first (fewer tokens), so finishing order is not input order.
    prompts = [ids(range(1, 1 + n)) for n in (40, 3, 25, 9, 60)]
    max_tokens = [20, 15, 10, 5, 1]
    outputs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(tokens(o)) for o in outputs] == max_tokens
    assert len({o.request_id for o in outputs}) == len(prompts)
    # Each output is what that prompt gives alone.
    for prompt, m, output in zip(prompts, max_tokens, outputs):
        (alone,) = llm.generate(prompt, greedy(m), use_tqdm=False)
        assert tokens(alone) == tokens(output)


def test_string_and_token_id_prompts_agree(llm):
    text = "The quick brown fox"
    prompt_ids = llm.get_tokenizer().encode(text)
    assert len(prompt_ids) == len(text.encode())  # the byte-level tokenizer: one per byte
    as_text, as_ids, as_list, as_dict = llm.generate(
        [text, ids(prompt_ids), prompt_ids, {"prompt": text}], greedy(), use_tqdm=False)
    assert as_text.prompt == text and as_dict.prompt == text
    assert as_ids.prompt is None
    for output in (as_text, as_ids, as_list, as_dict):
        assert output.prompt_token_ids == prompt_ids
        assert tokens(output) == tokens(as_text)
        assert output.outputs[0].text == as_text.outputs[0].text
    # A bare list of ints is one prompt, not many.
    assert len(llm.generate(prompt_ids, greedy(), use_tqdm=False)) == 1


def test_list_of_sampling_params(llm):
    prompts = ["a", "bb", "ccc"]
    params = [greedy(2), greedy(5), SamplingParams(temperature=0.9, seed=4, max_tokens=7,
                                                   ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(tokens(o)) for o in outputs] == [2, 5, 7]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_n_completions_with_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate("tell me", params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in output.outputs)
    assert all(c.finish_reason == "length" for c in output.outputs)
    completions = [tuple(c.token_ids) for c in output.outputs]
    assert len(set(completions)) == 3, "three samples at temperature 1 should differ"
    # The seed makes it reproducible, even batched with other requests.
    _, again, _ = llm.generate(["x" * 30, "tell me", "y"], [greedy(), params, greedy(3)],
                               use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == completions
    # A different seed gives different samples.
    (other,) = llm.generate("tell me", SamplingParams(n=3, temperature=1.0, seed=999,
                                                      max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    assert [tuple(c.token_ids) for c in other.outputs] != completions


def test_seeded_sampling_survives_preemption(llama_dir):
    """A seeded request's tokens do not depend on the batch, preemption included."""
    prompts = [ids(range(1 + 40 * i, 35 + 40 * i)) for i in range(3)]
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=40, ignore_eos=True)
              for i in range(3)]
    roomy = LLM(str(llama_dir), block_size=8, max_model_len=128)
    reference = roomy.generate(prompts, params, use_tqdm=False)
    assert all(o.metrics.num_preemptions == 0 for o in reference)
    # 16 blocks of 8 tokens for three requests that grow to 9-10 blocks each.
    tight = LLM(str(llama_dir), block_size=8, max_model_len=128, num_gpu_blocks_override=17)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [tokens(o) for o in outputs] == [tokens(o) for o in reference]


def test_chat_applies_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"}]
    (output,) = llm.chat(messages, greedy(4), use_tqdm=False)
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert output.prompt == expected
    assert "<|im_start|>user" in output.prompt
    tokenizer = llm.get_tokenizer()
    assert output.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    im_start = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(im_start) == 1 and output.prompt_token_ids.count(im_start[0]) == 3
    assert len(tokens(output)) == 4
    # A list of conversations gives one output each, in order; no generation prompt if asked.
    outputs = llm.chat([messages, messages[1:]], greedy(2), use_tqdm=False,
                       add_generation_prompt=False)
    assert len(outputs) == 2
    assert outputs[0].prompt == expected[:-len("<|im_start|>assistant\n")]
    assert outputs[1].prompt == "<|im_start|>user\nHi there<|im_end|>\n"


def test_max_model_len_limits_generation(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=32)
    prompt = ids(range(1, 21))
    with pytest.raises(ValueError, match="20 prompt tokens \\+ max_tokens 100 = 120"):
        llm.generate(prompt, greedy(100), use_tqdm=False)
    (output,) = llm.generate(prompt, greedy(None), use_tqdm=False)
    assert len(tokens(output)) == 12
    assert output.outputs[0].finish_reason == "length"
    (exact,) = llm.generate(prompt, greedy(12), use_tqdm=False)
    assert tokens(exact) == tokens(output)


def test_stop_token_ids(llm):
    prompt = ids([5, 6, 7, 8, 9])
    (free,) = llm.generate(prompt, greedy(16), use_tqdm=False)
    reference = tokens(free)
    k = next(i for i in range(3, 16) if reference[i] not in reference[:i])
    stop_id = reference[k]
    (stopped,) = llm.generate(prompt, greedy(16, stop_token_ids=[stop_id]), use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.token_ids == reference[:k + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_id
    # As in vLLM, the stop token is in token_ids but not in the text.
    tokenizer = llm.get_tokenizer()
    assert completion.text == tokenizer.decode(reference[:k], skip_special_tokens=True)
    assert completion.text_offsets is None  # kept with logprobs only
    (logged,) = llm.generate(prompt, greedy(16, stop_token_ids=[stop_id], logprobs=0),
                             use_tqdm=False)
    offsets = logged.outputs[0].text_offsets
    assert len(offsets) == k + 1 and offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[k] == len(completion.text)  # the stop token starts where the text ends
    # A stop string in text min_tokens held back from the search is not looked for again
    # when the stop token adds no text (vLLM's: no new text, no stop string).
    held = greedy(16, stop_token_ids=[stop_id], min_tokens=k,
                  stop=[completion.text[-2:], "longer than the text's tail"])
    (late,) = llm.generate(prompt, held, use_tqdm=False)
    assert (late.outputs[0].text, late.outputs[0].stop_reason) == (completion.text, stop_id)


@pytest.fixture(scope="module")
def eos_setup(llama_dir, tmp_path_factory):
    """A copy of the tiny llama whose EOS is a token its greedy output reaches at index k."""
    plain = LLM(str(llama_dir))
    prompt = ids([11, 12, 13])
    (free,) = plain.generate(prompt, greedy(16), use_tqdm=False)
    reference = tokens(free)
    k = next(i for i in range(2, 16)
             if reference[i] not in reference[:i] and reference[i] != EOS_ID)
    folder = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": reference[k]}))
    return LLM(str(folder)), prompt, reference, k


def test_eos_stops_generation(eos_setup):
    llm, prompt, reference, k = eos_setup
    assert reference[k] in llm.get_tokenizer().eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=16)
    (stopped,) = llm.generate(prompt, params, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.token_ids == reference[:k + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == reference[k]  # the generation config's, as vLLM's
    assert completion.text == llm.get_tokenizer().decode(reference[:k], True)
    # ignore_eos runs on to max_tokens; min_tokens masks EOS until it is reached.
    (ignored,) = llm.generate(prompt, greedy(16), use_tqdm=False)
    assert tokens(ignored) == reference
    (at_least,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                      min_tokens=k + 2), use_tqdm=False)
    assert len(tokens(at_least)) >= k + 2
    assert tokens(at_least)[:k] == reference[:k]
    assert tokens(at_least)[k] != reference[k]


def test_priority_argument(llama_dir):
    llm = LLM(str(llama_dir), scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b", "c"], greedy(2), priority=[0, 1], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    outputs = llm.generate(["a", "b", "c"], greedy(2), priority=[2, 0, 1], use_tqdm=False)
    assert [o.prompt for o in outputs] == ["a", "b", "c"]
    assert all(len(tokens(o)) == 2 for o in outputs)
    # Lower value first: with one request at a time, "b" then "c" then "a" run.
    llm = LLM(str(llama_dir), scheduling_policy="priority", max_num_seqs=1)
    outputs = llm.generate(["a", "b", "c"], greedy(2), priority=[2, 0, 1], use_tqdm=False)
    finish = [o.metrics.finished_time for o in outputs]
    assert finish[1] < finish[2] < finish[0]


def test_empty_prompt_list(llm):
    assert llm.generate([], greedy(), use_tqdm=False) == []


def test_generate_with_tqdm(llm, capsys):
    outputs = llm.generate(["one", "two"], greedy(3), use_tqdm=True)
    assert [len(tokens(o)) for o in outputs] == [3, 3]
    assert "Processed prompts" in capsys.readouterr().err
    # Same tokens as without the progress bar.
    quiet = llm.generate(["one", "two"], greedy(3), use_tqdm=False)
    assert [tokens(o) for o in quiet] == [tokens(o) for o in outputs]


def test_after_an_interrupted_generate_the_next_bar_counts_its_own_prompts(llm, capsys,
                                                                          monkeypatch):
    """The requests a Ctrl-C aborted report their abort in the next call's first step: the
    next bar counted them as its own ("9it" for one prompt)."""
    engine, step = llm.llm_engine, llm.llm_engine.step
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a"] * 8, greedy(50), use_tqdm=False)
    monkeypatch.undo()
    capsys.readouterr()
    (output,) = llm.generate(["b"], greedy(3), use_tqdm=True)
    assert len(tokens(output)) == 3
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "1/1 [" in bar, bar


def test_generate_from_two_threads_at_once(llm):
    """The second call waits for the first: two threads stepping one engine at once took
    each other's outputs, and neither call returned (its requests and blocks held for good)."""
    import threading

    prompts = [[ids(range(1, 20)), ids(range(5, 9))], [ids(range(30, 70)), ids([3])]]
    alone = [[tokens(o) for o in llm.generate(p, greedy(16), use_tqdm=False)] for p in prompts]
    results = [None, None]

    def call(i):
        results[i] = [tokens(o) for o in llm.generate(prompts[i], greedy(16), use_tqdm=False)]

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert results == alone
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_bytes_are_not_a_prompt(llm):
    with pytest.raises(TypeError, match="got bytes"):
        llm.generate(b"hello", greedy(), use_tqdm=False)


def test_numpy_token_ids_are_token_ids(llm):
    import numpy as np

    prompt = [5, 9, 13, 2]
    (expected,) = llm.generate(ids(prompt), greedy(4), use_tqdm=False)
    for given in (np.array(prompt), [np.int64(t) for t in prompt]):
        (output,) = llm.generate({"prompt_token_ids": given}, greedy(4), use_tqdm=False)
        assert output.prompt_token_ids == prompt and tokens(output) == tokens(expected)
    (single,) = llm.generate([np.int32(t) for t in prompt], greedy(4), use_tqdm=False)
    assert tokens(single) == tokens(expected)


@pytest.mark.parametrize("prompt,message", [
    ({"prompt_token_ids": 5}, "prompt_token_ids must be a list of token ids, got int"),
    ({"prompt_token_ids": [1, True]}, "token ids must be integers, got bool True"),
    ({"prompt_token_ids": [1, 2.0]}, "token ids must be integers, got float 2.0")])
def test_prompt_token_ids_that_are_not_token_ids(llm, prompt, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompt, greedy(), use_tqdm=False)


def test_sampling_params_list_of_something_else(llm):
    with pytest.raises(TypeError, match="a list holding NoneType"):
        llm.generate(["a"], [None], use_tqdm=False)


def test_a_none_token_id_is_not_a_token_id(llm):
    with pytest.raises(TypeError, match="got NoneType None"):
        llm.generate({"prompt_token_ids": [1, None]}, greedy(), use_tqdm=False)


def test_chat_joins_text_parts_as_the_server_does(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    (output,) = llm.chat(parts, greedy(2), use_tqdm=False)
    assert output.prompt == "<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="messages.0.content.0: Value error, content parts "
                                         "of type 'image_url' are not supported"):
        llm.chat(image, greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="conversations of at least one message"):
        llm.chat([[]], greedy(2), use_tqdm=False)


def test_chat_continues_the_final_message_where_asked(llm):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Once up "}]
    (closed,) = llm.chat(history, greedy(1), use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt.endswith(" Once up <|im_end|>\n")
    (open_,) = llm.chat(history, greedy(1), use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)
    assert open_.prompt == closed.prompt[:closed.prompt.rindex("<|im_end|>")]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llm.llm_engine.config.model)
    # Texts that also occur in the template's own closing tags ("d", "end", "<") or are empty.
    for final in (" Once up ", "d", "end", "m", "<", ""):
        chat = [history[0], {"role": "assistant", "content": final}]
        ours = llm.get_tokenizer().apply_chat_template(chat, False,
                                                       continue_final_message=True)
        assert ours == hf.apply_chat_template(chat, tokenize=False,
                                              continue_final_message=True), final
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(history, greedy(1), use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="does not appear in the rendered chat template"):
        llm.chat(history, greedy(1), use_tqdm=False, add_generation_prompt=False,
                 continue_final_message=True, chat_template="{{ messages[0]['content'] }}")


def test_chat_refuses_a_conversation_too_long_to_tokenize_unless_its_end_is_kept(llm):
    """As a text prompt is: tokenizing it whole took seconds and gigabytes."""
    engine = llm.llm_engine
    words = 2 * engine.config.max_model_len * engine.tokenizer.max_chars_per_token // 6 + 1
    huge = [{"role": "user", "content": "hello " * words}]
    with pytest.raises(ValueError, match="characters long"):
        llm.chat(huge, greedy(1), use_tqdm=False)
    kept = SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=7)
    (output,) = llm.chat(huge, kept, use_tqdm=False)
    assert len(output.prompt_token_ids) == 7
    assert "<|im_start|>assistant\n".endswith(output.prompt)  # its last 7 tokens


USER = {"role": "user", "content": "hi"}
ROLES = "messages.0.role: String should have at most 64 characters"


@pytest.mark.parametrize("messages, error", [
    ([{"content": "hi"}], "messages.0.role: Field required"),
    ([{"role": "w" * 65, "content": "hi"}], ROLES),
    ([{"role": "user", "content": 5}], "messages.0.content: Input should be a valid string"),
    ([{"role": "user"}], "messages.0: Value error, a user message needs content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content part needs 'text'"),
    ([{"role": "user", "content": [{"type": "text", "text": 123}]}],
     "messages.0.content.0.text: Input should be a valid string"),
    ([USER, {"role": "tool", "content": "x"}], "messages.1: .*needs tool_call_id"),
    ([{**USER, "tool_calls": []}], "only assistant messages carry tool_calls"),
    ([USER, {"role": "assistant", "tool_calls": "abc"}],
     "messages.1.tool_calls: Input should be a valid list"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": "a", "function": "f"}]}],
     "messages.1.tool_calls.0.function: Input should be a valid dictionary"),
    ([USER] * 10_001, "10,001 messages, more than the 10,000 allowed"),
])
def test_chat_refuses_the_messages_the_server_refuses(llm, messages, error):
    """One rule for both (fulcrum.chat_messages): each refusal names the message and field."""
    with pytest.raises(ValueError, match=error):
        llm.chat(messages, greedy(2), use_tqdm=False)
    (output,) = llm.chat([{"role": "assistant", "content": None}, USER], greedy(1),
                         use_tqdm=False)
    assert output.prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_takes_conversations_as_transformers_writes_them(llm):
    """Calls without ids, a tool answer naming its function, and keys of the template's own
    (transformers' `thinking`): the first two were refused, the last dropped."""
    history = [USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "name": "f", "content": "22"}]
    (output,) = llm.chat(history, greedy(1), use_tqdm=False)
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in output.prompt
    assert "<tool_response>\n22\n</tool_response>" in output.prompt
    template = "{% for m in messages %}[{{ m.thinking }}:{{ m.mood }}]{% endfor %}"
    (output,) = llm.chat([{**USER, "mood": "glad"}, {"role": "assistant", "content": "A",
                                                     "thinking": "hmm"}],
                         greedy(1), use_tqdm=False, chat_template=template)
    assert output.prompt == "[:glad][hmm:]"


def test_chat_takes_a_calls_arguments_as_text_or_as_an_object(llm):
    calls = [{"id": "a", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    as_text = llm.chat([USER, {"role": "assistant", "tool_calls": calls}], greedy(1),
                       use_tqdm=False)
    calls[0]["function"]["arguments"] = {"x": 1}
    as_object = llm.chat([USER, {"role": "assistant", "tool_calls": calls}], greedy(1),
                         use_tqdm=False)
    assert as_text[0].prompt == as_object[0].prompt
    assert '"arguments": {"x": 1}' in as_text[0].prompt


@pytest.mark.parametrize("tools, error", [
    ([{"x": 1}], "tools.0.function: Field required"),
    ([{"type": "function", "function": {}}], "tools.0.function.name: Field required"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type: Input should be"),
    (["f"], "tools.0: Input should be a valid dictionary"),
    ([{"type": "function", "function": {"name": 5}}], "tools.0.function.name: Input should "
                                                      "be a valid string"),
    ([{"type": "function", "function": {"name": "a b"}}], "String should match pattern"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}],
     "tools.0.function.parameters: Input should be a valid dictionary"),
])
def test_chat_refuses_tools_the_server_refuses(llm, tools, error):
    with pytest.raises(ValueError, match=error):
        llm.chat([USER], greedy(1), use_tqdm=False, tools=tools)


@pytest.mark.parametrize("messages, kwargs, kind, error", [
    ([], {}, ValueError, "conversations of at least one message"),
    (USER, {}, TypeError, "messages must be a conversation .* got dict"),
    ([USER], {"chat_template": 5}, TypeError, "chat_template must be a template's text"),
    ([USER], {"chat_template": "{{ 1/0 }}"}, ValueError,
     "the chat template failed: division by zero"),
    ([USER], {"chat_template": "{{ raise_exception('no system') }}"}, ValueError,
     "the chat template failed: no system"),
    ([USER], {"chat_template": "{{ nothing.here.at_all }}"}, ValueError,
     "the chat template failed: 'nothing' is undefined"),
    ([USER], {"chat_template_kwargs": [1]}, TypeError, "chat_template_kwargs must be a dict"),
    ([USER], {"chat_template_kwargs": {5: 1}}, TypeError, "chat_template_kwargs must be a dict"),
    ([USER], {"chat_template_kwargs": {"messages": []}}, ValueError,
     "chat_template_kwargs cannot set messages"),
    ([USER], {"chat_template_kwargs": {"documents": 5}}, TypeError,
     "Documents should be a list of dicts"),
    ([USER], {"add_generation_prompt": "no"}, TypeError,
     "add_generation_prompt must be True or False, got 'no'"),
    ([USER], {"continue_final_message": "no"}, TypeError,
     "continue_final_message must be True or False"),
])
def test_chat_names_what_is_wrong_with_its_arguments(llm, messages, kwargs, kind, error):
    with pytest.raises(kind, match=error):
        llm.chat(messages, greedy(1), use_tqdm=False, **kwargs)


def test_chat_takes_the_servers_message_objects(llm):
    from fulcrum.chat_messages import ChatMessage

    (as_dicts,) = llm.chat([USER], greedy(1), use_tqdm=False)
    (as_models,) = llm.chat([ChatMessage(**USER)], greedy(1), use_tqdm=False)
    assert as_models.prompt == as_dicts.prompt


def test_chat_takes_a_conversation_from_any_iterable(llm):
    (listed,) = llm.chat([USER], greedy(1), use_tqdm=False, lora_request=None)
    (generated,) = llm.chat((m for m in [USER]), greedy(1), use_tqdm=False)
    assert generated.prompt == listed.prompt
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.chat([USER], greedy(1), use_tqdm=False, lora_request=object())


@pytest.mark.parametrize("prompts", [None, 5, 2.5])
def test_generate_names_what_it_takes(llm, prompts):
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids, a dict "
                                        "or a list of those, got"):
        llm.generate(prompts, greedy(1), use_tqdm=False)


def test_max_queued_requests_is_refused_offline(llama_dir, capsys):
    """Only the server bounds its queue with it; LLM and the engine queue all they get."""
    from fulcrum.cli import main
    from fulcrum.config import EngineConfig
    from fulcrum.engine import LLMEngine

    refused = r"^max_queued_requests is a server setting \(fulcrum serve bounds its waiting"
    with pytest.raises(ValueError, match=refused):
        LLM(str(llama_dir), max_queued_requests=1)
    with pytest.raises(ValueError, match=refused):
        LLMEngine(EngineConfig(model=str(llama_dir), max_queued_requests=1))
    # and the commands other than serve have no such flag
    for command in (["generate", "--prompt", "x"], ["demo"], ["bench", "throughput"]):
        with pytest.raises(SystemExit) as usage:
            main([*command, "--max-queued-requests", "1"])
        assert usage.value.code == 2
        assert "unrecognized arguments: --max-queued-requests" in capsys.readouterr().err
