"""The built-in default model: needs no download, so `LLM()` and the demo work anywhere.

It is a Llama with SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN
1536, tied embeddings, bfloat16, which fulcrum's CPU kernels run at twice float32's speed)
and random weights (`load_format="dummy"`, seeded), paired
with a byte-level tokenizer built here (256 byte tokens plus ChatML specials). Its text is
noise; its cost per token is that of the real 135M model, which is what the demo and the
benchmarks need. The folder (config and tokenizer, no weights) is written once under
$FULCRUM_CACHE (default ~/.cache/fulcrum).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DEFAULT_MODEL_NAME = "fulcrum-default-135m"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 320  # 256 bytes + specials, padded to a multiple of 64

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 256,
    "eos_token_id": 258,
    "torch_dtype": "bfloat16",
}

# ChatML, with tools as Qwen2.5 renders them (Hermes format): the function signatures in the
# system turn, calls as <tool_call> JSON in assistant turns, results as <tool_response>.
# (Newlines right after a block tag are written {{ '\n' }}: the renderer trims the others.)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """256 byte tokens, the ChatML specials, and reserved tokens up to `vocab_size`."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_order = sorted(alphabet, key=lambda ch: ord(ch))
    vocab = {ch: i for i, ch in enumerate(byte_order)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - len(SPECIAL_TOKENS))]
    tokenizer.add_special_tokens(SPECIAL_TOKENS + reserved)
    return tokenizer


def default_model_dir() -> str:
    """Write the default model's folder if needed and return its path."""
    return ensure_config_folder(cache_root() / DEFAULT_MODEL_NAME, CONFIG)


def cache_root() -> Path:
    return Path(os.environ.get("FULCRUM_CACHE", Path.home() / ".cache" / "fulcrum"))


def ensure_config_folder(folder: Path, config: Dict[str, Any]) -> str:
    """A config-only model folder (config.json and a byte-level tokenizer), written again when
    either differs from what this version of fulcrum writes."""
    config_file, tokenizer_config = folder / "config.json", folder / "tokenizer_config.json"
    if config_file.is_file() and json.loads(config_file.read_text()) == config \
            and tokenizer_config.is_file() \
            and json.loads(tokenizer_config.read_text()).get("chat_template") == CHAT_TEMPLATE:
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_byte_level_tokenizer(folder, config["vocab_size"], config["max_position_embeddings"])
    config_file.write_text(json.dumps(config, indent=2))
    return str(folder)


def write_byte_level_tokenizer(folder: Path, vocab_size: int, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (EOS <|im_end|>, ChatML template) in `folder`."""
    byte_level_tokenizer(vocab_size).save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": max_length}, indent=2))
