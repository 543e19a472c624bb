"""``python -m fusion.generation``: generate from a Hugging Face Llama directory."""

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import torch

from fusion.checkpoint import CheckpointError, load_hf_llama
from fusion.generation.autoregressive import generate_stream
from fusion.generation.padding import left_pad

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusion.generation",
        description=(
            "Load a Hugging Face Llama directory (config.json + safetensors) and generate. "
            "Prompts are text (needs tokenizer.json in the directory and the `tokenizers` "
            "package, or a tokenizer `transformers` can load offline) or comma-separated "
            "token ids. One prompt streams its tokens as they come; several print one line each."
        ),
    )
    parser.add_argument("--checkpoint", required=True, type=Path, help="the model directory")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    prompts.add_argument(
        "--prompt-ids", action="append", help="a prompt as comma-separated token ids (repeatable)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument(
        "--stop-token",
        type=int,
        action="append",
        help="an id that ends a prompt's generation (repeatable); default: the config's EOS ids",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="no stop tokens")
    parser.add_argument(
        "--pad-id", type=int, default=None, help="left-padding id (default: pad_token_id, else 0)"
    )
    parser.add_argument(
        "--dtype", choices=["auto", *_DTYPES], default="auto", help="auto: as stored"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="override max_position_embeddings"
    )
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 bad checkpoint or input)."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    directory: Path = args.checkpoint
    tokenizer = None
    if args.prompt is not None:
        tokenizer = load_tokenizer(directory)
        if tokenizer is None:
            parser.error(
                f"--prompt: text needs a tokenizer: none could be loaded offline from "
                f"{directory} (tokenizer.json with `tokenizers`, or `transformers`); "
                "pass --prompt-ids instead"
            )
        prompts = [tokenizer.encode(text) for text in args.prompt]
    else:
        prompts = [_parse_ids(parser, text) for text in args.prompt_ids]
    try:
        config = _generation_config(directory)
        stop_tokens = (
            ()
            if args.ignore_eos
            else args.stop_token
            if args.stop_token is not None
            else _as_ids(config.get("eos_token_id"))
        )
        pad_id = args.pad_id if args.pad_id is not None else _first(config.get("pad_token_id"), 0)
        dtype = None if args.dtype == "auto" else _DTYPES[args.dtype]
        model = load_hf_llama(
            directory, dtype=dtype, device=args.device, max_seq_len=args.max_seq_len
        ).eval()
        tokens = left_pad(prompts, pad_id, device=args.device)
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
        steps = generate_stream(
            model,
            tokens,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_tokens=stop_tokens,
            pad_id=pad_id,
            generator=generator,
        )
        _print(steps, len(prompts), stop_tokens, tokenizer, out)
    except (CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


class Tokenizer:
    """The two calls the CLI needs, over whichever library loaded the tokenizer."""

    def __init__(
        self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]
    ) -> None:
        self.encode, self.decode = encode, decode


def load_tokenizer(directory: Path) -> Tokenizer | None:
    """The directory's tokenizer, loaded offline, or None when there is none or no library."""
    if (directory / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            pass
        else:
            fast = HFTokenizer.from_file(str(directory / "tokenizer.json"))
            return Tokenizer(
                lambda text: fast.encode(text).ids,
                lambda ids: fast.decode(ids, skip_special_tokens=True),
            )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        loaded = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError):
        return None
    return Tokenizer(loaded.encode, lambda ids: loaded.decode(ids, skip_special_tokens=True))


def _print(
    steps, n_prompts: int, stop_tokens: Sequence[int], tokenizer: Tokenizer | None, out: TextIO
) -> None:
    generated: list[list[int]] = [[] for _ in range(n_prompts)]
    finished = [False] * n_prompts
    shown = ""
    for step in steps:
        for i, token in enumerate(step.tolist()):
            if not finished[i]:
                generated[i].append(token)
                finished[i] = token in stop_tokens
        if n_prompts == 1:  # stream: print what this step added
            if tokenizer is None:
                out.write(("" if len(generated[0]) == 1 else ",") + str(generated[0][-1]))
            else:
                text = tokenizer.decode(generated[0])
                out.write(text[len(shown) :] if text.startswith(shown) else "\n" + text)
                shown = text
            out.flush()
    if n_prompts == 1:
        out.write("\n")
        return
    for ids in generated:
        out.write((",".join(map(str, ids)) if tokenizer is None else tokenizer.decode(ids)) + "\n")


def _parse_ids(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"--prompt-ids: expected comma-separated integers, got {text!r}")
    return ids


def _generation_config(directory: Path) -> dict:
    """``generation_config.json`` over ``config.json`` (for EOS and pad ids)."""
    config = {}
    for name in ("config.json", "generation_config.json"):
        file = directory / name
        if file.is_file():
            try:
                content = json.loads(file.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
                raise CheckpointError(file, None, f"unreadable: {error}") from error
            if not isinstance(content, dict):
                raise CheckpointError(file, None, "expected a JSON object")
            config |= {k: v for k, v in content.items() if v is not None}
    return config


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _first(value: int | list[int] | None, default: int) -> int:
    ids = _as_ids(value)
    return ids[0] if ids else default
