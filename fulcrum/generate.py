"""`fulcrum generate`: one prompt in, text out, for a quick look at a model."""

from __future__ import annotations

import argparse
import dataclasses

from fulcrum.config import check_slo_targets_read
from fulcrum.engine_args import add_engine_args, engine_kwargs

# The SamplingParams fields generate has flags for (besides --sampling-seed), and their types.
SAMPLING_FLAGS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text for one prompt",
        description="Generate a completion for one prompt. The sampling flags left out take "
                    "the model's defaults (--generation-config), else SamplingParams' (16 "
                    "tokens at temperature 1.0), as LLM.generate does.")
    parser.add_argument("model", nargs="?", default=None,
                        help="local Hugging Face model folder (default: built-in model)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    for name, kind in SAMPLING_FLAGS.items():  # None: not given
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fulcrum import LLM

    check_slo_targets_read(args.scheduling_policy, False, {
        "--slo-ttft-ms": args.slo_ttft_ms, "--slo-tpot-ms": args.slo_tpot_ms},
        "generate shows no metrics")
    llm = LLM(**engine_kwargs(args))
    try:
        given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
        given["seed"] = args.sampling_seed  # (--seed is the engine's)
        given = {name: value for name, value in given.items() if value is not None}
        params = dataclasses.replace(llm.get_default_sampling_params(), **given)
        if args.chat:
            output = llm.chat([{"role": "user", "content": args.prompt}], params,
                              use_tqdm=False)[0]
        else:
            output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()  # tensor-parallel ranks end now, not at the interpreter's exit
    completion = output.outputs[0]
    print(completion.text)
    print(f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
          f"finish_reason={completion.finish_reason}, "
          f"TTFT {output.metrics.time_to_first_token * 1000:.0f} ms]")
    return 0
