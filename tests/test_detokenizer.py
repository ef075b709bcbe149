"""IncrementalDetokenizer with the real tokenizers: split characters, stop strings, hold-back."""

from __future__ import annotations

from typing import List, Optional, Tuple

import pytest

from fulcrum.detokenizer import MAX_UNREAD_TOKENS, IncrementalDetokenizer
from fulcrum.outputs import Logprob
from fulcrum.sampling_params import SamplingParams
from fulcrum.tokenizer import LONG_TEXT_CHARS, Tokenizer

TEXTS = ["héllo wörld 你好 🎉", "Once upon a time there was a cat.", "a  b\n\nc 🎉🎉 ü", "🎉"]


@pytest.fixture(scope="module")
def byte_tok(llama_dir) -> Tokenizer:
    return Tokenizer(str(llama_dir))


@pytest.fixture(scope="module")
def stories_tok(stories_dir) -> Tokenizer:
    return Tokenizer(str(stories_dir))


@pytest.fixture(params=["byte", "stories"])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tok")


def feed(tokenizer: Tokenizer, ids: List[int], chunk: int = 1,
         **params) -> Tuple[IncrementalDetokenizer, List[str], Optional[str]]:
    """Feed ids `chunk` at a time until a stop string; (detokenizer, texts seen, stop)."""
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(**params))
    seen = []
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i:i + chunk])
        seen.append(detok.output_text)
        if stop is not None:
            return detok, seen, stop
    return detok, seen, None


def encode(tokenizer: Tokenizer, text: str) -> List[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_byte_level_splits_multibyte_characters_across_tokens(byte_tok):
    text = TEXTS[0]
    ids = encode(byte_tok, text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    detok, seen, stop = feed(byte_tok, ids)
    assert stop is None
    assert detok.output_text == byte_tok.decode(ids) == text
    for partial in seen:
        assert "\ufffd" not in partial
        assert text.startswith(partial)
    # The emoji is 4 byte tokens: no text appears for its first three.
    assert seen[-4] == seen[-3] == seen[-2] == text[:-1]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_full_decode(tok, text, chunk):
    ids = encode(tok, text)
    detok, seen, _ = feed(tok, ids, chunk=chunk)
    full = tok.decode(ids)
    assert detok.output_text == full
    for partial in seen:
        assert "\ufffd" not in partial
        assert full.startswith(partial)


def test_stories_byte_fallback_and_word_spaces(stories_tok):
    ids = encode(stories_tok, TEXTS[0])
    pieces = [stories_tok.id_to_token(i) for i in ids]
    assert "<0xC3>" in pieces and "<0xF0>" in pieces  # byte fallback really used
    detok, seen, _ = feed(stories_tok, ids)
    # The SentencePiece leading space of the first token is dropped, later ones kept.
    assert detok.output_text == TEXTS[0]
    assert seen[pieces.index("▁w")] == "héllo w"
    assert seen[pieces.index("<0xC3>")] == "héllo w"  # half of "ö": held
    assert seen[pieces.index("<0xB6>")] == "héllo wö"


def test_invalid_bytes_are_emitted_once_followed_by_valid_text(byte_tok):
    lone_ff = byte_tok._tok.token_to_id("ÿ")  # the byte-level token of byte 0xFF
    assert byte_tok.decode([lone_ff]) == "\ufffd"  # not valid UTF-8 on its own
    ids = encode(byte_tok, "x") + [lone_ff] + encode(byte_tok, "ab")
    detok, seen, _ = feed(byte_tok, ids)
    assert detok.output_text == byte_tok.decode(ids)
    assert seen[0] == "x"


def test_special_tokens_skipped_or_kept(byte_tok):
    ids = encode(byte_tok, "hi") + [257] + encode(byte_tok, "yo")
    skipped, _, _ = feed(byte_tok, ids)
    assert skipped.output_text == "hiyo"
    kept, _, _ = feed(byte_tok, ids, skip_special_tokens=False)
    assert kept.output_text == "hi<|im_start|>yo"


# ------------------------------------------------------------------ stop strings
@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_stop_string_split_across_tokens_is_truncated(tok, chunk):
    text = "Once upon a time there was a cat."
    ids = encode(tok, text)
    stop_str = "e the"  # spans "▁time" / "▁there" in stories, five bytes in byte-level
    detok, _, stop = feed(tok, ids, chunk=chunk, stop=[stop_str])
    assert stop == stop_str
    assert detok.output_text == "Once upon a tim"
    kept, _, _ = feed(tok, ids, chunk=chunk, stop=[stop_str], include_stop_str_in_output=True)
    assert kept.output_text == "Once upon a time the"


def test_stop_inside_one_token_cuts_the_rest_of_it(stories_tok):
    ids = encode(stories_tok, "hello world and more")
    assert stories_tok.id_to_token(ids[6]) == "▁and"
    detok, _, stop = feed(stories_tok, ids, stop=["an"])
    assert stop == "an"
    assert detok.output_text == "hello world "
    kept, _, _ = feed(stories_tok, ids, stop=["an"], include_stop_str_in_output=True)
    assert kept.output_text == "hello world an"


def test_earliest_stop_string_wins(tok):
    ids = encode(tok, "hello world and more")
    detok, _, stop = feed(tok, ids, chunk=100, stop=["world", "lo"])
    assert stop == "lo"
    assert detok.output_text == "hel"


def test_stop_string_at_the_very_start(tok):
    detok, _, stop = feed(tok, encode(tok, "STOP and go"), stop=["STOP"])
    assert stop == "STOP"
    assert detok.output_text == ""


def test_stop_string_with_multibyte_characters(byte_tok):
    ids = encode(byte_tok, "say 你好 now")
    detok, _, stop = feed(byte_tok, ids, stop=["你好"])
    assert stop == "你好"
    assert detok.output_text == "say "


def test_no_stop_string_no_match(tok):
    ids = encode(tok, "hello world")
    detok, _, stop = feed(tok, ids, stop=["xyz"])
    assert stop is None
    assert detok.output_text == "hello world"


# --------------------------------------------------------------------- hold-back
def test_visible_text_never_shows_a_stop_string_prefix(tok):
    text = "Once upon a time there was a cat."
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["there"]))
    shown = []
    for token in ids:
        stop = detok.update([token])
        shown.append(detok.visible_text(finished=stop is not None))
        if stop:
            break
    final = "Once upon a time "
    assert detok.output_text == final
    assert shown[-1] == final
    for text_shown in shown:
        assert final.startswith(text_shown)  # nothing streamed that was later taken back
    assert not any(t.endswith(("t", "th", "the", "ther")) and len(t) > len(final)
                   for t in shown)


def test_hold_back_releases_on_finish(tok):
    ids = encode(tok, "hello world")
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"]))
    detok.update(ids)
    assert detok.visible_text(finished=False) == "hello wo"  # 3 = len("STOP") - 1 held
    assert detok.visible_text(finished=True) == "hello world"


def test_no_hold_back_without_stop_strings(tok):
    ids = encode(tok, "hello world")
    detok = IncrementalDetokenizer(tok, SamplingParams())
    detok.update(ids)
    assert detok.visible_text(finished=False) == "hello world"


def test_single_character_stop_needs_no_hold_back(tok):
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["!"]))
    detok.update(encode(tok, "hello"))
    assert detok.visible_text(finished=False) == "hello"


@pytest.mark.parametrize("prompt, completion", [
    ("Once upon", " a time there was a cat."),  # SentencePiece drops a first token's space
    ("She said: héllo", " wörld 你好 🎉"),
    ("🎉", "🎉 ü"),  # the prompt's last character is a whole emoji of several byte tokens
])
def test_a_completion_is_what_its_tokens_add_to_the_prompt(tok, prompt, completion):
    """Decoded after the prompt's last tokens, as vLLM does: prompt + completion reads as the
    whole text, where decoding the output alone loses the leading space of its first word."""
    prompt_ids = tok.encode(prompt)  # with BOS where the tokenizer adds one
    ids = encode(tok, prompt + completion)[len(encode(tok, prompt)):]
    assert tok.decode(encode(tok, prompt) + ids) == prompt + completion  # a clean split
    for chunk in (1, 3):
        detok = IncrementalDetokenizer(tok, SamplingParams(), prompt_ids)
        for i in range(0, len(ids), chunk):
            detok.update(ids[i:i + chunk])
        assert detok.output_text == completion


def test_a_prompt_that_ends_inside_a_character_lets_the_output_complete_it(stories_tok):
    """Token ids may cut a character (a client resuming a generation): the output's text
    starts with that character once complete, and loses none of its own."""
    prompt = stories_tok.encode("Once")
    rest = encode(stories_tok, "Hello 你好 world")  # byte-fallback: 3 tokens per character
    assert [stories_tok.decode([t]) for t in rest[4:10]] == ["\ufffd"] * 6
    expected = {3: " 你好 world", 4: "你好 world", 5: "你好 world", 6: "你好 world",
                7: "好 world", 8: "好 world", 9: "好 world", 10: " world", 11: "orld"}
    for cut, text in expected.items():
        detok = IncrementalDetokenizer(stories_tok, SamplingParams(), prompt + rest[:cut])
        for token_id in rest[cut:]:
            detok.update([token_id])
        assert detok.output_text == text, cut


def test_bytes_at_the_prompt_end_that_no_output_completes_stay_the_prompts(byte_tok):
    """A prompt of token ids may end in a byte that starts no character (a lone UTF-8
    continuation byte), in one followed by a whole character, or in a lead byte the output
    does not complete: their U+FFFD and text are the prompt's, not the output's (the text
    came out as "\ufffdxy", "\ufffdAxy"). A lead byte the output completes is the output's."""
    hi, (lead, continuation) = encode(byte_tok, "Hi"), encode(byte_tok, "é")
    assert byte_tok.decode([continuation]) == byte_tok.decode([lead]) == "\ufffd"
    output = encode(byte_tok, "xy")
    cases = [(*hi, continuation), (*hi, continuation, *encode(byte_tok, "A")), (*hi, lead),
             (*hi, continuation, lead)]
    for prompt in cases:
        detok = IncrementalDetokenizer(byte_tok, SamplingParams(), list(prompt))
        for token_id in output:
            detok.update([token_id])
        assert detok.output_text == "xy", prompt
    for prompt in ([*hi, lead], [*hi, continuation, lead], [*hi, continuation, *encode(
            byte_tok, "A"), lead]):  # the stray bytes before the lead stay the prompt's
        detok = IncrementalDetokenizer(byte_tok, SamplingParams(), prompt)
        for token_id in [continuation] + output:
            detok.update([token_id])
        assert detok.output_text == "éxy", prompt


def test_a_prompt_ending_in_u_fffd_keeps_the_outputs_leading_space(stories_tok):
    """No window of the prompt's last tokens is free of U+FFFD (a literal one, or bytes that
    are no character): the output is still decoded after the prompt's last tokens, so a
    SentencePiece word keeps its leading space (decoded alone it lost it)."""
    lily = stories_tok.vocab()["\u2581Lily"]
    for prompt in ("Mojibake \ufffd\ufffd here", "a girl \ufffd"):
        prompt_ids = stories_tok.encode(prompt)
        detok = IncrementalDetokenizer(stories_tok, SamplingParams(), prompt_ids)
        detok.update([lily])
        detok.update([lily])
        whole = stories_tok.decode(prompt_ids + [lily, lily])
        assert detok.output_text == whole[len(stories_tok.decode(prompt_ids)):] == " Lily Lily"


def test_a_prompt_ending_in_u_fffd_and_a_characters_start_lets_the_output_complete_it(
        stories_tok):
    """Where no window of the prompt is free of U+FFFD, the start of a character the prompt
    leaves incomplete is still the output's to complete (it was counted as read: lost)."""
    ni = encode(stories_tok, "你好 world")  # "▁" then 你 as three byte tokens
    for head in ("Once", "Once \ufffd"):
        detok = IncrementalDetokenizer(stories_tok, SamplingParams(),
                                       stories_tok.encode(head) + ni[:2])
        for token_id in ni[2:]:
            detok.update([token_id])
        assert detok.output_text == "你好 world", head


def merged_byte_tokenizer(tmp_path) -> Tokenizer:
    """A byte-level BPE tokenizer (Qwen2's kind) with one token that holds a whole character
    and the first byte of the next: "日" + the lead byte of "本"."""
    import json

    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def chars(text: str) -> str:  # one character for each byte of the text's UTF-8
        return byte_level.pre_tokenize_str(text)[0][0]

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    pieces = list(chars("日")) + [chars("本")[0]]
    merges, token = [], pieces[0]
    for piece in pieces[1:]:
        merges.append((token, piece))
        token += piece
        vocab[token] = len(vocab)
    model = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    model.pre_tokenizer = byte_level
    model.decoder = decoders.ByteLevel()
    folder = tmp_path / "bpe"
    folder.mkdir()
    model.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    return Tokenizer(str(folder))


def test_the_text_of_tokens_still_unread_at_the_end_is_flushed(tmp_path):
    """An output that ends on a token leaving a character incomplete: its text is what
    tokenizer.decode gives (the complete characters that token holds, then U+FFFD), where
    it was dropped whole; while the request runs, that token's text stays unread."""
    tok = merged_byte_tokenizer(tmp_path)
    merged = max(tok.vocab().values())
    assert tok.decode([merged]) == "日\ufffd"
    output = encode(tok, "hi ") + [merged]
    running = IncrementalDetokenizer(tok, SamplingParams(), encode(tok, "Say: "))
    running.update(output)
    assert running.output_text == "hi "
    ending = IncrementalDetokenizer(tok, SamplingParams(), encode(tok, "Say: "))
    ending.update(output, final=True)
    assert ending.output_text == tok.decode(output) == "hi 日\ufffd"
    completed = IncrementalDetokenizer(tok, SamplingParams(), encode(tok, "Say: "))
    completed.update(output + encode(tok, "本")[1:], final=True)
    assert completed.output_text == "hi 日本"


def test_text_flushed_at_a_stop_token_is_searched_for_stop_strings(tmp_path):
    """A request that ends on a stop token flushes its unread text too: a stop string in it
    cuts the text there and is the stop reason, as in text that came before; the stop
    token's own text offset is where the text then ends."""
    from fulcrum.core.request import Request, RequestStatus
    from fulcrum.output_processor import OutputProcessor
    from fulcrum.outputs import SampledToken

    tok = merged_byte_tokenizer(tmp_path)
    merged, eos = max(tok.vocab().values()), encode(tok, "!")[0]
    for stop, text, reason in ((["日"], "hi ", "日"), ([], "hi 日\ufffd", eos)):
        params = SamplingParams(stop=stop, stop_token_ids=[eos], max_tokens=10, logprobs=0)
        request = Request("r", encode(tok, "Say: "), params, max_tokens=10)
        processor = OutputProcessor(tok)
        processor.add_request("r", None, [request])
        tokens = encode(tok, "hi ") + [merged, eos]
        for i, token in enumerate(tokens):
            request.append_token(token)
            if i == len(tokens) - 1:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, eos
            processor.process_tokens({"r": SampledToken(token, {token: Logprob(-1.0, 1)})})
        detokenizer = processor._parents["r"].children[0].detokenizer
        assert (detokenizer.output_text, request.stop_reason) == (text, reason)
        assert detokenizer.text_offsets[-1] == len(text)


def offsets_of(tokenizer: Tokenizer, ids: List[int], chunk: int = 1, **params) -> List[int]:
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(**params), record_offsets=True)
    for i in range(0, len(ids), chunk):
        detok.update(ids[i:i + chunk])
    return detok.text_offsets


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_text_offsets_are_where_each_tokens_text_starts(tok, text, chunk):
    """OpenAI's text_offset: token i starts where the text of the tokens before it ends; the
    byte tokens of one character all start where it does."""
    ids = encode(tok, text)
    expected, start = [], 0
    for i in range(len(ids)):
        before = tok.decode(ids[:i])
        if not before.endswith("\ufffd"):
            start = len(before)
        expected.append(start)
    assert offsets_of(tok, ids, chunk) == expected


def test_a_token_after_a_byte_that_is_no_character_starts_after_its_u_fffd(byte_tok):
    lead, continuation = encode(byte_tok, "é")
    ids = encode(byte_tok, "a") + [lead, continuation, continuation] + encode(byte_tok, "xy")
    assert byte_tok.decode(ids) == "aé\ufffdxy"
    assert offsets_of(byte_tok, ids) == [0, 1, 1, 2, 3, 4]


def test_special_tokens_take_no_width_where_skipped(byte_tok):
    ids = encode(byte_tok, "hi") + [257] + encode(byte_tok, "yo")
    assert offsets_of(byte_tok, ids) == [0, 1, 2, 2, 3]
    assert offsets_of(byte_tok, ids, skip_special_tokens=False) == [0, 1, 2, 14, 15]


def test_text_that_never_completes_a_character_is_read_in_a_bounded_window(byte_tok):
    """Bytes that are no UTF-8 (or skipped special tokens) kept every token unread: each
    step decoded them all (quadratic: 3,000 such tokens took 1.1 s and gave no text)."""
    lead, continuation = encode(byte_tok, "é")
    for ids in ([continuation] * 300, encode(byte_tok, "ab") + [257] * 300 + encode(byte_tok, "c"),
                [lead] * 300, ([continuation] * 5 + encode(byte_tok, "é")) * 40):
        detok = IncrementalDetokenizer(byte_tok, SamplingParams())
        for token_id in ids:
            detok.update([token_id])
            assert len(detok.tokens) - detok.prefix_offset <= 3 * MAX_UNREAD_TOKENS
        full = byte_tok.decode(ids, skip_special_tokens=True)
        assert full.startswith(detok.output_text)
        assert len(full) - len(detok.output_text) <= MAX_UNREAD_TOKENS  # a tail maybe held


def test_skipped_special_tokens_do_not_part_a_characters_bytes(byte_tok):
    lead, continuation = encode(byte_tok, "é")
    ids = encode(byte_tok, "a") + [lead] + [257] * (2 * MAX_UNREAD_TOKENS) + [continuation]
    detok = IncrementalDetokenizer(byte_tok, SamplingParams())
    for token_id in ids:
        detok.update([token_id])
    assert detok.output_text == byte_tok.decode(ids, skip_special_tokens=True) == "aé"


def test_long_texts_go_through_the_batch_calls_alike(tok):
    """Past LONG_TEXT_CHARS the tokenizers library's batch calls (which let go of the GIL,
    so the server's event loop runs on) must give what the single ones give."""
    text = (TEXTS[0] + " " + TEXTS[1]) * (LONG_TEXT_CHARS // 20)
    assert len(text) > LONG_TEXT_CHARS
    ids = tok.encode(text)
    assert ids == tok._tok.encode(text).ids
    assert tok.decode(ids) == tok._tok.decode(ids, skip_special_tokens=False)
