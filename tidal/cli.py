"""Command line: `tidal generate`."""

from __future__ import annotations

import argparse
import sys

from tidal.config import DTYPES


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or a HF Llama directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--speculative-method", default="none", choices=["none", "ngram", "eagle3"])
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--draft-model", default=None, help="EAGLE-3 head directory (HF layout)")


def _engine_kwargs(args) -> dict:
    from tidal.config import SpecConfig

    return dict(dtype=args.dtype, device=args.device,
                spec=SpecConfig(args.speculative_method, args.num_speculative_tokens,
                                draft_model=args.draft_model))


def _generate(args) -> int:
    from tidal import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.no_chat:
        out = llm.generate(args.prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(out.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt with the chat template applied")
    g.add_argument("prompt")
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="send the prompt as raw text")
    g.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # InvalidParameter and bad config values
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
