"""fulcrum's Tokenizer against transformers' AutoTokenizer (vLLM's) on the same folder."""

from __future__ import annotations

import json
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
