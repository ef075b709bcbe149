"""Chat templates render as transformers renders them (the reference vLLM serves with): its
globals and filters, named templates, the variables it always defines, messages as it
normalises them. Each case renders with fulcrum's Tokenizer and with transformers'
apply_chat_template on the same folder, and compares the text (or the error)."""

from __future__ import annotations

import json
import shutil
from datetime import datetime

import pytest
from transformers import AutoTokenizer

from fulcrum.tokenizer import Tokenizer

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def folder_with(tmp_path, llama_dir, template, **config):
    """The tiny model's tokenizer with `template` (and `config`) in tokenizer_config.json."""
    folder = tmp_path / "tokenizer"
    folder.mkdir(exist_ok=True)
    shutil.copy(llama_dir / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template, **config}))
    return folder


def render_both(folder, messages, **kwargs):
    """(transformers', fulcrum's) rendering: the text, or the error's type and message."""
    def attempt(render):
        try:
            return render()
        except Exception as error:  # noqa: BLE001 - compared, not handled
            return f"{type(error).__name__}: {error}"

    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer(str(folder))
    kwargs.setdefault("add_generation_prompt", False)
    return (attempt(lambda: hf.apply_chat_template(messages, tokenize=False, **kwargs)),
            attempt(lambda: ours.apply_chat_template(messages, **kwargs)))


CASES = {
    # transformers' globals and filters
    "strftime_now": ("{{ strftime_now('%Y') }}", USER, {}),
    "tojson options": ("{{ {'b': [1, 2], 'a': 'é<'} | tojson(sort_keys=True, "
                       "separators=(',', ':'), ensure_ascii=True) }}", USER, {}),
    "generation tag": ("{% for m in messages %}{% generation %}{{ m.content }}"
                       "{% endgeneration %}{% endfor %}", USER, {}),
    "namespace underscore": ("{% set ns = namespace(_x=1) %}{{ ns._x }}", USER, {}),
    # the variables it always defines, and only those
    "tools and documents none": ("{{ tools is none }} {{ documents is none }}", USER, {}),
    "special tokens": ("[{{ pad_token }}][{{ unk_token is defined }}][{{ bos_token }}]", USER,
                       {}),
    # messages: None values dropped, reasoning under each of its names
    "none content": ("{% for m in messages %}[{{ m.role }}:{{ m.content }}]"
                     "{{ 'content' in m }}{% endfor %}",
                     USER + [{"role": "assistant", "content": None, "name": None}], {}),
    "reasoning alias": ("{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}"
                        "{% endfor %}",
                        [{"role": "assistant", "content": "A", "reasoning": "why"}], {}),
    # continue_final_message on content given as parts
    "continue parts": ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}"
                       "{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}"
                       "{% endfor %}{% endif %}</s>{% endfor %}",
                       USER + [{"role": "assistant",
                                "content": [{"type": "text", "text": "Partial"}]}],
                       {"continue_final_message": True}),
    "continue nothing": ("{% for m in messages %}{{ m.content }}{% endfor %}",
                         USER + [{"role": "assistant", "content": None}],
                         {"continue_final_message": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_renders_as_transformers(tmp_path, llama_dir, name):
    template, messages, kwargs = CASES[name]
    folder = folder_with(tmp_path, llama_dir, template, pad_token="<pad>")
    hf, ours = render_both(folder, messages, **kwargs)
    assert ours == hf


def test_a_template_dated_by_strftime_now_is_dated_today(tmp_path, llama_dir):
    """Llama 3.2's template dates its system prompt, falling back to 26 Jul 2024 where
    strftime_now is not defined (it was not)."""
    template = ("{% if strftime_now is defined %}{{ strftime_now('%d %b %Y') }}"
                "{% else %}26 Jul 2024{% endif %}")
    hf, ours = render_both(folder_with(tmp_path, llama_dir, template), USER)
    assert ours == hf == datetime.now().strftime("%d %b %Y")


def test_named_templates_are_chosen_as_transformers_chooses(tmp_path, llama_dir):
    """"tool_use" where tools are given (Hermes' templates), else "default"; without a
    default, an error naming them."""
    named = [{"name": "default", "template": "plain"},
             {"name": "tool_use", "template": "tools: {{ tools | length }}"}]
    folder = folder_with(tmp_path, llama_dir, named)
    assert render_both(folder, USER) == ("plain", "plain")
    assert render_both(folder, USER, tools=[WEATHER]) == ("tools: 1", "tools: 1")
    assert render_both(folder, USER, chat_template="tool_use", tools=[]) == ("tools: 0",) * 2
    hf, ours = render_both(folder_with(tmp_path, llama_dir, named[1:]), USER)
    assert ours == hf and "no default specified" in ours


def test_templates_and_special_tokens_are_found_where_transformers_finds_them(tmp_path,
                                                                             llama_dir):
    """additional_chat_templates/*.jinja (newer transformers saves tool_use templates there)
    beside chat_template.jinja as "default"; special tokens also from special_tokens_map.json,
    a model's own `*_token` entries and extra_special_tokens."""
    folder = folder_with(tmp_path, llama_dir, "CONFIG", image_token="<img>",
                         extra_special_tokens={"audio_token": "<aud>"})
    (folder / "chat_template.jinja").write_text("DEFAULT {{ image_token }}{{ audio_token }}"
                                                "{{ sep_token }}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools|length }}")
    (folder / "special_tokens_map.json").write_text(json.dumps({"sep_token": "<sep>"}))
    assert render_both(folder, USER) == ("DEFAULT <img><aud><sep>",) * 2
    assert render_both(folder, USER, tools=[WEATHER]) == ("TOOLS 1", "TOOLS 1")
    (folder / "chat_template.jinja").unlink()
    hf, ours = render_both(folder, USER)
    assert ours == hf and "no default specified" in ours


class _Writer:
    def write(self) -> str:
        return "WROTE"


def test_a_template_sees_plain_data_only(tmp_path, llama_dir):
    """The sandbox lets a template call an object's public methods: objects a caller passes
    (LLM.chat's messages and keywords) reach it as placeholders, as in transformers."""
    import enum

    class Mode(str, enum.Enum):
        A = "alpha"

    folder = folder_with(tmp_path, llama_dir, "{{ messages[0].x.write() if messages[0].x.write "
                         "is defined else messages[0].x }}|{{ mode }}")
    messages = [{"role": "user", "content": "Hi", "x": _Writer()}]
    assert Tokenizer(str(folder)).apply_chat_template(messages, mode=Mode.A) == \
        "<_Writer>|alpha"


def test_strftime_now_takes_no_field_widths(tmp_path, llama_dir):
    """A width inside the format ("%9999Y" repeated) cost seconds and hundreds of MB."""
    folder = folder_with(tmp_path, llama_dir, "{{ strftime_now('%9999Y') }}")
    with pytest.raises(Exception, match="strftime_now takes no field widths"):
        Tokenizer(str(folder)).apply_chat_template(USER)


def test_the_server_passes_an_assistant_messages_reasoning_to_the_template():
    """Templates that keep past reasoning (Qwen3's <think>) read it; the server dropped it."""
    from fulcrum.server.protocol import ChatMessage

    message = ChatMessage.model_validate({"role": "assistant", "content": "A",
                                          "reasoning_content": "why", "reasoning": "so"})
    assert message.template_dict() == {"role": "assistant", "content": "A",
                                       "reasoning_content": "why", "reasoning": "so"}


GEMMA3_LIKE = ("{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
               "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
               "{% for item in message['content'] %}<{{ item['text'] }}>{% endfor %}"
               "{% endif %}{% endfor %}")


MISTRAL_NEMO_LIKE = ("{% for message in messages %}{% if message.tool_calls is defined %}"
                     "{% set tool_calls = message.tool_calls %}{% else %}"
                     "{% set tool_calls = message.content %}{% endif %}"
                     "{% for tool_call in tool_calls %}{% endfor %}"
                     "{{ '[INST]' + message['content'] }}{% endfor %}")


@pytest.mark.parametrize("template, found", [
    (GEMMA3_LIKE, "openai"),
    ("{% for m in messages | selectattr('role') %}{% for p in m['content'] | list %}"
     "{% endfor %}{% endfor %}", "openai"),
    # vLLM follows names bound to the messages, not names bound to a message's content: a
    # loop over such a name (Mistral-Nemo's tool calls) leaves the template a string one,
    # which then adds content to text (a list there failed every request).
    (MISTRAL_NEMO_LIKE, "string"),
    ("{% set first = messages[0] %}{% for p in first['content'] %}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m['content'] }}{% for t in tools %}{% endfor %}{% endfor %}",
     "string"),
    ("{% set a = messages %}{% set b = a %}{% set a = b %}{% for m in b %}"
     "{% for p in m.content %}{% endfor %}{% endfor %}", "openai"),  # a cycle of names
    ("{% for i, m in messages | enumerate %}{% endfor %}", "string"),  # vLLM gives up
])
def test_content_format_is_detected_as_vllm_detects_it(template, found):
    from fulcrum.chat_template import content_format

    assert content_format(template) == found
    assert content_format(template, "string") == "string"


def test_content_and_tool_calls_as_vllm_hands_them_to_templates():
    from fulcrum.chat_template import message_content, template_tool_calls

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
             {"type": "text", "text": None}, {"type": "text", "text": "b", "x": 1}]
    assert message_content(parts, "string") == "a\nb"
    assert message_content(parts, "openai") == [{"type": "text", "text": t}
                                                for t in ("a", "", "b")]
    assert message_content(None, "string") == "" and message_content(None, "openai") == []
    assert message_content("c", "openai") == [{"type": "text", "text": "c"}]
    calls = [{"id": "1", "function": {"name": "f", "arguments": args}}
             for args in ('{"city": "Paris"}', "", None, "not json", {"a": 1})]
    assert [c["function"]["arguments"] for c in template_tool_calls(calls)] == [
        {"city": "Paris"}, {}, {}, "not json", {"a": 1}]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's untouched
    assert template_tool_calls([]) is None


def test_llm_chat_gives_content_in_the_templates_format(llama_dir):
    """A template that loops over content parts (Gemma 3's) gets parts, text given as a string
    included; one that prints content gets parts joined; both as vLLM gives them."""
    from fulcrum import LLM, SamplingParams

    llm = LLM(str(llama_dir))
    chat = [{"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "user", "content": "c"}]
    params = SamplingParams(max_tokens=1)

    def prompt(template, **kwargs):
        return llm.chat(chat, params, use_tqdm=False, chat_template=template,
                        **kwargs)[0].prompt

    assert prompt(GEMMA3_LIKE) == "<a><b><c>"
    assert prompt("{% for m in messages %}[{{ m.content }}]{% endfor %}") == "[S][a\nb][c]"
    assert prompt(GEMMA3_LIKE, chat_template_content_format="string") == "a\nbc"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        prompt(GEMMA3_LIKE, chat_template_content_format="parts")


def test_tool_results_roles_and_tool_definitions_reach_templates_as_vllm_hands_them(
        llama_dir):
    """A tool result's text is one string even for a template that loops over content parts
    (Mistral Small 3's printed the parts' Python repr); any role a template knows passes
    (Llama 3's "ipython", Mistral's "tool_results"), and one it does not is its own error;
    keys of a tool definition OpenAI's schema does not name reach the template too."""
    from fulcrum import LLM, SamplingParams

    llm = LLM(str(llama_dir))
    template = ("{% for m in messages %}{% if m.role == 'tool' %}[T:{{ m.content | string }}]"
                "{% elif m.role in ('user', 'ipython') %}{% for p in m.content %}"
                "[{{ m.role }}:{{ p.text }}]{% endfor %}{% else %}"
                "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{% endfor %}"
                "{% for t in tools or [] %}<{{ t.function['return'].type }}>{% endfor %}")
    chat = [{"role": "user", "content": "a"},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "21"},
                                                                {"type": "text", "text": "C"}]},
            {"role": "ipython", "content": "b"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {},
                                               "return": {"type": "string"}}}]

    def prompt(messages, **kwargs):
        return llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False,
                        chat_template=template, **kwargs)[0].prompt

    assert prompt(chat, tools=tools) == "[user:a][T:21\nC][ipython:b]<string>"
    with pytest.raises(ValueError, match="unknown role wizard"):
        prompt([{"role": "wizard", "content": "x"}])


def test_the_built_in_template_puts_consecutive_tool_results_in_one_turn(llama_dir):
    """As Qwen2.5's template does (the built-in ChatML one opened a user turn for each)."""
    from fulcrum import LLM, SamplingParams

    chat = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}} for i in (1, 2)]},
            {"role": "tool", "tool_call_id": "c1", "content": "a"},
            {"role": "tool", "tool_call_id": "c2", "content": "b"},
            {"role": "user", "content": "x"}]
    (output,) = LLM(str(llama_dir)).chat(chat, SamplingParams(max_tokens=1), use_tqdm=False)
    assert ("<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
            "</tool_response><|im_end|>\n<|im_start|>user\nx<|im_end|>\n") in output.prompt


def test_llm_chat_hands_tool_call_arguments_as_objects(llama_dir):
    """As vLLM's LLM.chat and fulcrum's server do (a template printed the JSON text again)."""
    from fulcrum import LLM, SamplingParams

    llm = LLM(str(llama_dir))
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                "{{ c.function.arguments | tojson }}{% endfor %}[{{ m.content }}]{% endfor %}")
    (output,) = llm.chat(chat, SamplingParams(max_tokens=1), use_tqdm=False,
                         chat_template=template)
    assert output.prompt == '[Weather?]{"city": "Paris"}[]'


@pytest.mark.parametrize("template, message", [
    # Two nested ranges are 10**10 steps: a render thread busy for hours (8 held every
    # chat request up); all of a render's ranges together give at most 2**20 items.
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loops over ranges take more than"),
    # Squaring a number 40 times: minutes, and memory without end.
    ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
     "{% endfor %}", "multiplies two numbers into too large a number"),
    # Blocks nested past what Python compiles: an HTTP 500 before.
    ("{% for a in [1] %}" * 30 + "{% endfor %}" * 30, "nests too deeply to compile"),
])
def test_runaway_templates_are_refused(tmp_path, llama_dir, template, message):
    import jinja2

    tokenizer = Tokenizer(str(folder_with(tmp_path, llama_dir, template)))
    with pytest.raises(jinja2.TemplateError, match=message):
        tokenizer.apply_chat_template(USER)


def test_ordinary_loops_and_long_chains_of_names_still_render(tmp_path, llama_dir):
    from fulcrum.chat_template import content_format

    folder = folder_with(tmp_path, llama_dir, "{% for i in range(100000) %}{% endfor %}"
                                              "{{ 7 * 6 }}")
    assert Tokenizer(str(folder)).apply_chat_template(USER) == "42"
    chain = "{% set a0 = messages %}" + "".join(f"{{% set a{i} = a{i - 1} %}}"
                                                for i in range(1, 3000))
    loop = "{% for m in a2999 %}{% for p in m.content %}{% endfor %}{% endfor %}"
    assert content_format(chain + loop) == "openai"  # 38 s before (a walk per name)


def test_inputs_that_nest_without_end_are_refused_clearly(tmp_path, llama_dir):
    tokenizer = Tokenizer(str(folder_with(tmp_path, llama_dir, "{{ messages }}")))
    itself = [1]
    itself.append(itself)
    with pytest.raises(ValueError, match="nests too deeply, or holds itself"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x", "extra": itself}])


def test_a_long_inline_template_is_no_files_name():
    """--chat-template with a template longer than a file name may be (it raised OSError)."""
    from fulcrum.chat_template import load_chat_template

    template = "{% for m in messages %}" + "x" * 300 + "{{ m.content }}{% endfor %}"
    assert load_chat_template(template) == template
