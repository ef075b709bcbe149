"""What int8 (`--quantization int8`) costs in quality, on a real model.

stories260K (../shared/models/stories260K, a trained Llama) in bfloat16, with and without
int8 (weights with a scale per output channel, computed at load, and each input row
quantized at run time; the LM head too):
- greedy agreement: for each of the model's greedy reference prompts, the share of generated
  tokens before int8's first difference from bf16, and the share of answers identical;
- next-token distributions on real text (a few paragraphs of plain English below): the mean
  KL divergence KL(bf16 || int8) over every position, from full-vocabulary prompt logprobs
  (stories260K's vocabulary is 512 tokens); bf16's own divergence from float32 is given
  beside it, for scale.

    python benchmarks/int8_quality.py      # writes results/int8_quality.{json,md}
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from fulcrum import LLM, SamplingParams
from fulcrum.bench.report import machine_facts, results_name, write_results

ROOT = Path(__file__).resolve().parent
MODEL = ROOT.parent.parent / "shared" / "models" / "stories260K"
TEXT = ("Tom had a red ball. He liked to play with it in the park every day. One morning the "
        "ball rolled into the pond, and Tom was sad. His friend Lily saw him crying. She took "
        "a long stick and pulled the ball out of the water. Tom said thank you and they played "
        "together until the sun went down. When it was time to go home, Tom gave Lily a big "
        "hug. The next day they met again in the park, and they were happy.")


def llm(**kwargs) -> LLM:
    return LLM(str(MODEL), max_logprobs=512, scheduling_policy="fcfs", **kwargs)


def distributions(model: LLM, token_ids):
    params = SamplingParams(max_tokens=1, prompt_logprobs=512)
    entries = model.generate([{"prompt_token_ids": token_ids}], params,
                             use_tqdm=False)[0].prompt_logprobs
    return [{t: lp.logprob for t, lp in e.items()} for e in entries[1:]]


def mean_kl(reference, other) -> float:
    values = [sum(math.exp(p[t]) * (p[t] - q[t]) for t in p) for p, q in zip(reference, other)]
    return statistics.fmean(values)


def main() -> None:
    stem, command, _ = results_name("int8_quality.py", __doc__, "int8_quality")
    cases = json.loads((MODEL / "greedy_reference.json").read_text())["cases"]
    bf16, int8, fp32 = llm(dtype="bfloat16"), llm(dtype="bfloat16", quantization="int8"), \
        llm(dtype="float32")
    prefix_shares, identical = [], 0
    for case in cases:
        params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=True)
        prompt = [{"prompt_token_ids": case["prompt_token_ids"]}]
        a = bf16.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        b = int8.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix_shares.append(same / len(a))
        identical += a == b
    tokens = bf16.get_tokenizer().encode(TEXT)
    reference = distributions(bf16, tokens)
    data = {"model": "stories260K", "cases": len(cases), "text_tokens": len(tokens),
            "greedy_identical_share": identical / len(cases),
            "greedy_prefix_share_mean": statistics.fmean(prefix_shares),
            "kl_bf16_int8": mean_kl(reference, distributions(int8, tokens)),
            "kl_fp32_bf16": mean_kl(distributions(fp32, tokens), reference),
            "machine": machine_facts()}
    lines = ["# int8: quality on a real model", "",
             f"stories260K, bf16 with and without `--quantization int8`; "
             f"{data['machine']['date']}; regenerate with `{command}`.",
             "", "| measure | value |", "|---|---:|",
             f"| greedy answers identical to bf16 ({len(cases)} reference prompts) | "
             f"{100 * data['greedy_identical_share']:.0f}% |",
             f"| tokens before the first difference (mean share of the answer) | "
             f"{100 * data['greedy_prefix_share_mean']:.0f}% |",
             f"| mean KL(bf16 ∥ int8) of next-token distributions ({len(tokens)} tokens of "
             f"text) | {data['kl_bf16_int8']:.5f} nats |",
             f"| for scale: mean KL(fp32 ∥ bf16) | {data['kl_fp32_bf16']:.5f} nats |"]
    write_results(ROOT / "results", stem, data, lines)


if __name__ == "__main__":
    main()
