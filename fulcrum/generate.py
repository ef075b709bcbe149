"""`fulcrum generate`: one prompt in, text out, for a quick look at a model."""

from __future__ import annotations

import argparse

from fulcrum.engine_args import add_engine_args, engine_kwargs


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt",
                                   description="Generate a completion for one prompt.")
    parser.add_argument("model", nargs="?", default=None,
                        help="local Hugging Face model folder (default: built-in model)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fulcrum import LLM, SamplingParams

    if args.scheduling_policy != "slo" and (args.slo_ttft_ms, args.slo_tpot_ms) != (None, None):
        # A server's metrics judge goodput by them under any policy; generate shows none.
        raise ValueError("--slo-ttft-ms and --slo-tpot-ms steer only --scheduling-policy slo "
                         "in generate")
    llm = LLM(**engine_kwargs(args))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
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
