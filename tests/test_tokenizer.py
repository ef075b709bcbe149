"""fulcrum's Tokenizer against transformers' AutoTokenizer (vLLM's) on the same folder."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from fulcrum.tokenizer import Tokenizer

TEXTS = ["Hello world", " two  spaces \n", "<|im_start|>user\nhi<|im_end|>", "emoji 😀 é"]


def slow_tokenizer_folder(llama_dir: Path, folder: Path) -> Path:
    """The tiny model's tokenizer as a Qwen2-style slow tokenizer ships it: vocab.json and
    merges.txt, its added tokens in tokenizer_config.json, no tokenizer.json."""
    folder.mkdir()
    backend = HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    backend.model.save(str(folder))
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    added = json.loads(backend.to_str())["added_tokens"]
    config.update(tokenizer_class="Qwen2Tokenizer", added_tokens_decoder={
        str(token.pop("id")): token for token in added})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_without_tokenizer_json_is_converted_as_transformers_does(llama_dir,
                                                                           tmp_path):
    """vLLM loads tokenizers with AutoTokenizer, which converts vocab.json + merges.txt (or
    a SentencePiece tokenizer.model); fulcrum refused such a folder."""
    transformers = pytest.importorskip("transformers")
    folder = slow_tokenizer_folder(llama_dir, tmp_path / "slow")
    ours, theirs = Tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        for add in (True, False):
            ids = theirs.encode(text, add_special_tokens=add)
            assert ours.encode(text, add) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_ids == {theirs.eos_token_id}


def test_a_folder_without_tokenizer_json_says_what_would_read_it(llama_dir, tmp_path,
                                                                 monkeypatch):
    folder = slow_tokenizer_folder(llama_dir, tmp_path / "slow")
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    with pytest.raises(FileNotFoundError, match="only vocab.json, merges.txt: install "
                                                "transformers"):
        Tokenizer(str(folder))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*fast"):
        Tokenizer(str(tmp_path))


@pytest.mark.parametrize("saved_by", ["transformers<4.34", "transformers>=4.34"])
def test_special_tokens_map_json_is_merged_as_transformers_merges_it(llama_dir, tmp_path,
                                                                      saved_by):
    """A folder whose special_tokens_map.json names other BOS/EOS than its
    tokenizer_config.json: transformers lets the map win where the config has no
    added_tokens_decoder (saved before 4.34) and does not read it otherwise; fulcrum let the
    config win always, so it stopped on another EOS than vLLM and wrote another BOS."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(llama_dir / "tokenizer.json", folder)
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())  # bos_token: null
    if saved_by == "transformers>=4.34":
        added = json.loads((llama_dir / "tokenizer.json").read_text())["added_tokens"][:3]
        config["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": {"content": "<|endoftext|>", "normalized": False},
        "bos_token": "<|im_start|>"}))
    ours, theirs = Tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.special_tokens.get("eos_token") == theirs.eos_token
    assert ours.special_tokens.get("bos_token") == theirs.bos_token
    assert ours.eos_token_ids == {theirs.eos_token_id}


def test_decode_keeps_special_tokens_unless_asked_as_transformers_does(llama_dir):
    """vLLM's get_tokenizer() is a transformers tokenizer, whose decode(ids) keeps special
    tokens; fulcrum's dropped them unless told (the tokenizers library's default)."""
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer(str(llama_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids) == theirs.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert ours.decode(ids, skip_special_tokens=True) == \
        theirs.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_special_tokens_map_json_is_not_read_beside_added_tokens_decoder(llama_dir, tmp_path):
    """transformers reads special_tokens_map.json only for a config without
    added_tokens_decoder: a pad_token the map alone names is none for a newer config, and
    fulcrum still filled it in from the map (a template saw a pad_token vLLM's does not)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(llama_dir / "tokenizer.json", folder)
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    added = json.loads((llama_dir / "tokenizer.json").read_text())["added_tokens"][:3]
    config["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    ours, theirs = Tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.special_tokens.get("pad_token") == theirs.pad_token is None
