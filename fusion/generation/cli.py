"""``python -m fusion.generation``: generate from a Hugging Face Llama or vision-language
model directory.

A checkpoint directory is untrusted input: nothing in it is ever executed (a tokenizer or config
that asks for its own Python code is refused, never offered), no file in it is read unless it
is a regular file of bounded size, and the command never reads stdin. Every error is one line
on stderr (``error: ...``) and a non-zero exit status: 2 for a bad command line, 1 for a bad
checkpoint or input, 130 when interrupted. Everything that can be checked without the weights
is checked before they are loaded.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import stat
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TextIO, cast

import torch

from fusion._arguments import as_device
from fusion.checkpoint import load_hf_model
from fusion.checkpoint.hf_vlm import hf_model_kind
from fusion.families import FAMILIES, family_named
from fusion.families.processor import KINDS
from fusion.generation.autoregressive import generate_stream
from fusion.generation.sampling import check_sampling_args
from fusion.hf.errors import CheckpointError
from fusion.hf.files import read_bounded, read_tokenizer
from fusion.padding import left_pad
from fusion.preprocessing import (
    detect_model_kind,
    load_image,
    load_video,
    prepare_inputs,
    probe_video,
    read_video_processor,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_JSON_BYTES = 16 << 20  # config.json and generation_config.json are a few KiB
_SEED_LOW, _SEED_HIGH = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {_one_line(message)} (see --help)\n")


def _number(kind: type, check: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` (int or float, finite), refused unless ``check``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            a = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {a}, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or not check(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


_POSITIVE = _number(int, lambda n: n >= 1, "an integer >= 1")
_ID = _number(int, lambda n: n >= 0, "an integer >= 0")
_SEED = _number(
    int, lambda n: _SEED_LOW <= n <= _SEED_HIGH, f"an integer in [{_SEED_LOW}, {_SEED_HIGH}]"
)


def _model_types() -> list[str]:
    return [model_type for family in FAMILIES for model_type in family.model_types]


def _image_markers() -> str:
    """Each processor's image marker and the model types it is for, from the registry."""
    types: dict[str, list[str]] = {}
    for family in FAMILIES:
        if family.processor is not None:
            marker = KINDS[family.processor].marker
            types.setdefault(marker, []).extend(family.model_types)
    return "; ".join(f"{marker} for {', '.join(names)}" for marker, names in types.items())


def _video_markers() -> str:
    """Each video marker and the model types whose models take videos, from the registry."""
    types: dict[str, list[str]] = {}
    for family in FAMILIES:
        if family.video_marker is not None:
            types.setdefault(family.video_marker, []).extend(family.model_types)
    return "; ".join(f"{marker} for {', '.join(names)}" for marker, names in types.items())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m fusion.generation",
        description="Load a Hugging Face directory (config.json + safetensors) of a model type "
        f"of fusion.families ({', '.join(_model_types())}) and generate. Prompts are text (needs "
        "tokenizer.json and `tokenizers`, or a tokenizer `transformers` loads offline without "
        "running the directory's code) or token ids. One prompt streams its tokens; several "
        "print a line each. Errors are one line on stderr: exit status 2 for a bad command "
        "line, 1 for a bad checkpoint or input.",
    )
    parser.add_argument("--checkpoint", required=True, type=Path, help="the model directory")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    prompts.add_argument(
        "--prompt-ids", action="append", help="a prompt as comma-separated token ids (repeatable)"
    )
    parser.add_argument(
        "--image",
        action="append",
        type=Path,
        help="an image file for the prompts' image markers, in order (repeatable): "
        f"{_image_markers()}; decoding needs Pillow (the vision extra)",
    )
    parser.add_argument(
        "--video",
        action="append",
        type=Path,
        help="a clip file for the prompts' video markers, in order (repeatable): "
        f"{_video_markers()}; its frames are kept and sized as the directory's video processor "
        "says; decoding needs PyAV (the video extra)",
    )
    parser.add_argument(
        "--max-pixels",
        type=_POSITIVE,
        default=None,
        help="the most pixels an --image may have, checked from its header before decoding, and "
        "at every step of its preprocessing (default: Pillow's decompression-bomb limit, "
        "89478485 pixels)",
    )
    parser.add_argument(
        "--print-ids",
        action="store_true",
        help="print token ids instead of text: one JSON line per prompt, "
        '{"prompt_ids": [...], "new_ids": [...]} (image markers expanded)',
    )
    parser.add_argument("--max-new-tokens", type=_POSITIVE, default=32, help="default: %(default)s")
    parser.add_argument(
        "--temperature",
        type=_number(float, lambda t: t >= 0, "a finite number >= 0"),
        default=1.0,
        help="0 is greedy",
    )
    parser.add_argument("--top-k", type=_POSITIVE, default=None)
    parser.add_argument(
        "--top-p", type=_number(float, lambda p: 0 < p <= 1, "a number in (0, 1]"), default=None
    )
    parser.add_argument("--seed", type=_SEED, default=0, help="seed of the sampling generator")
    parser.add_argument(
        "--stop-token",
        type=_ID,
        action="append",
        help="an id that ends a prompt's generation (repeatable); default: the config's EOS ids",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="no stop tokens")
    parser.add_argument(
        "--pad-id",
        type=_ID,
        default=None,
        help="left-padding id (default, as transformers reads it: pad_token_id of "
        "generation_config.json, else of config.json or its text config; one outside the "
        "vocabulary, such as SmolVLM's 128002, gives way to the first EOS id; else 0)",
    )
    parser.add_argument(
        "--dtype", choices=["auto", *_DTYPES], default="auto", help="auto: as stored"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--max-seq-len", type=_POSITIVE, default=None, help="override max_position_embeddings"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the prefill and the decoding step (torch.compile; CUDA graphs on CUDA); "
        "pays off for long generations",
    )
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 bad checkpoint or input, 130
    interrupted). A bad command line raises ``SystemExit(2)`` (argparse's convention)."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = as_device(args.device, "--device")
    except ValueError as error:
        parser.error(str(error))
    if device.type == "meta":
        parser.error("--device: the meta device holds no data; use cpu, cuda, ...")
    try:
        _run(parser, args, device, out)
    except KeyboardInterrupt:
        return _fail("interrupted", status=130)
    except BrokenPipeError:  # e.g. `| head`: stop quietly, and keep Python's exit flush quiet
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return _fail("the output was closed before generation ended")
    except (CheckpointError, ValueError, OSError) as error:
        return _fail(str(error))
    except Exception as error:  # the command line shows no tracebacks
        return _fail(f"{type(error).__name__}: {error}")
    return 0


def _run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device, out: TextIO
) -> None:
    directory: Path = args.checkpoint
    _check_directory(directory)
    # a vision-language model's processor kind, or the family's name where it has none
    kind = detect_model_kind(directory)
    text_only = kind not in KINDS  # prompts go through the tokenizer alone
    if args.image and text_only:
        what = family_named(kind).what
        parser.error(f"--image: {directory} holds a text-only model ({what}), taking no images")
    if args.image and args.prompt is None:
        parser.error("--image: images go where <image> markers are in a --prompt text")
    video_marker = family_named(hf_model_kind(directory)).video_marker if args.video else None
    if args.video and video_marker is None:
        parser.error(
            f"--video: {directory} holds a model that takes no videos ({_video_markers()})"
        )
    if args.video and args.prompt is None:
        parser.error(f"--video: videos go where {video_marker} is in a --prompt text")
    config = _generation_config(directory)
    vocab = _positive_int_or_none(config.get("vocab_size"))
    encoder_input, tokenizer = None, None
    if args.prompt is not None:
        tokenizer, reason = _load_tokenizer(directory)
        if tokenizer is None and not text_only:
            parser.error(f"--prompt: no tokenizer could be loaded from {directory} ({reason})")
        if tokenizer is None:
            parser.error(
                f"--prompt: text needs a tokenizer, and none could be loaded from {directory} "
                f"({reason}); pass --prompt-ids instead"
            )
    max_len = args.max_seq_len or _positive_int_or_none(config.get("max_position_embeddings"))
    if tokenizer is not None and not text_only:
        video_texts: list[str] = []
        videos: dict[str, Any] = {}
        if args.video:
            video_texts, videos = _videos(directory, args.video, device, max_len)
        images = [_load_image(path, args.max_pixels) for path in args.image or []]
        with _warnings_on_one_line():  # e.g. the image processor defaults
            inputs = prepare_inputs(
                directory,
                args.prompt,
                images,
                encode=tokenizer.encode,
                max_pixels=args.max_pixels,
                video_texts=video_texts,
            )
        prompts = inputs.ids
        if images or videos:
            encoder_input = {**(inputs.encoder_input(device=device) if images else {}), **videos}
    elif tokenizer is not None:
        prompts = [tokenizer.encode(text) for text in args.prompt]
        for text, ids in zip(args.prompt, prompts, strict=True):
            if not ids:
                raise ValueError(f"--prompt: the tokenizer gives no tokens for {text!r}")
        _check_ids_in_vocab("--prompt (as tokenized)", [i for p in prompts for i in p], vocab)
    else:
        prompts = [_parse_ids(parser, text) for text in args.prompt_ids]
        _check_ids_in_vocab("--prompt-ids", [i for p in prompts for i in p], vocab)

    if args.ignore_eos:
        stop_tokens: tuple[int, ...] = ()
    elif args.stop_token is not None:
        stop_tokens = tuple(args.stop_token)
        _check_ids_in_vocab("--stop-token", stop_tokens, vocab)
    else:
        stop_tokens = _as_ids(config.get("eos_token_id"))
        _check_ids_in_vocab("eos_token_id of the config", stop_tokens, vocab)
    if args.pad_id is not None:
        pad_id = args.pad_id
        _check_ids_in_vocab("--pad-id", [pad_id], vocab)
    else:
        with _warnings_on_one_line():  # a pad id outside the vocabulary
            pad_id = default_pad_id(config, vocab)
    check_sampling_args(args.temperature, args.top_k, args.top_p, vocab or sys.maxsize)
    tokens = left_pad(prompts, pad_id)
    needed = tokens.size(1) + args.max_new_tokens - 1  # the last new token is never fed back
    if max_len is not None and needed > max_len:
        raise ValueError(
            f"--max-new-tokens: the longest prompt ({tokens.size(1)} tokens) plus "
            f"{args.max_new_tokens} new tokens needs {needed} positions, more than the model's "
            f"{max_len} (--max-seq-len, or max_position_embeddings of config.json)"
        )

    dtype = None if args.dtype == "auto" else _DTYPES[args.dtype]
    model = load_hf_model(directory, dtype=dtype, device=device, max_seq_len=args.max_seq_len)
    model.eval()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    options = ("max_new_tokens", "temperature", "top_k", "top_p", "compile")
    steps = generate_stream(
        model, tokens.to(device), encoder_input=encoder_input, stop_tokens=stop_tokens,
        pad_id=pad_id, generator=generator, **{key: getattr(args, key) for key in options},
        stop_check_interval=1,  # each step's tokens are read here anyway (to print them)
    )  # fmt: skip
    try:
        if args.print_ids:
            _print_ids(steps, prompts, stop_tokens, out)
        else:
            _print(steps, len(prompts), stop_tokens, tokenizer, out)
    finally:
        steps.close()  # an error while printing still frees the KV cache


def _videos(
    directory: Path, paths: list[Path], device: torch.device, max_len: int | None
) -> tuple[list[str], dict[str, Any]]:
    """Each clip's prompt text (for its ``<|video_pad|>``) and the ``"video"`` encoder input
    of the clips, read with the directory's video processor (the grids and the seconds stay
    on the CPU, where the positions read them). The rows the clips bring are counted from
    their containers first: clips that alone pass ``max_len`` are refused before any frame is
    decoded."""
    with _warnings_on_one_line():  # e.g. the video processor defaults
        processor = read_video_processor(directory)
    rows = 0
    for path in paths:
        _, (t, h, w) = processor.plan(probe_video(path))
        rows += t * h * w // processor.merge_size**2
    if max_len is not None and rows > max_len:
        raise ValueError(
            f"--video: the clips bring {rows} placeholder rows, more than the model's {max_len} "
            "positions (--max-seq-len, or max_position_embeddings of config.json); nothing "
            "was decoded"
        )
    clips = [load_video(path, sampler=processor.sampler) for path in paths]
    patched = processor(clips)
    grids = patched.video_grid_thw
    texts = [
        processor.video_text(grid, metadata)
        for grid, metadata in zip(grids.tolist(), patched.metadata, strict=True)
    ]
    video = {
        "pixel_values_videos": patched.pixel_values_videos.to(device),
        "video_grid_thw": grids,
        # float32, as transformers' processors return them
        "second_per_grid_ts": torch.tensor(patched.second_per_grid_ts, dtype=torch.float32),
    }
    return texts, {"video": video}


@contextlib.contextmanager
def _warnings_on_one_line() -> Iterator[None]:
    """Warnings raised inside, printed on stderr as one line each."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        yield
    for warning in said:
        print(f"warning: {_one_line(str(warning.message))}", file=sys.stderr)


class Tokenizer(NamedTuple):
    """The two calls the CLI needs, over whichever library loaded the tokenizer."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def load_tokenizer(directory: Path) -> Tokenizer | None:
    """The directory's tokenizer, loaded offline, or None when there is none or no library.
    No code from the directory is ever run, and stdin is never read: a tokenizer that needs
    its own code (an ``auto_map``) is not loaded (None). ``CheckpointError``: a
    ``tokenizer.json`` that is unreadable, too large or corrupt."""
    return _load_tokenizer(Path(directory))[0]


def _load_tokenizer(directory: Path) -> tuple[Tokenizer | None, str]:
    """The tokenizer, or None and why not."""
    file = directory / "tokenizer.json"
    if file.exists() and importlib.util.find_spec("tokenizers") is not None:
        fast = read_tokenizer(file)
        return Tokenizer(
            lambda text: fast.encode(text).ids,
            lambda ids: fast.decode(ids, skip_special_tokens=True),
        ), ""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None, "no tokenizer.json, and `transformers` is not installed"
    try:
        with _stdin_never_read():
            loaded = AutoTokenizer.from_pretrained(
                directory, local_files_only=True, trust_remote_code=False
            )
    except Exception as error:  # transformers raises many kinds; report why
        reason = _one_line(str(error))
        reason = reason if len(reason) <= 300 else reason[:297] + "..."
        return None, f"transformers: {type(error).__name__}: {reason}"

    def decode(ids: list[int]) -> str:
        return cast(str, loaded.decode(ids, skip_special_tokens=True))  # ids in: one text out

    return Tokenizer(loaded.encode, decode), ""


@contextlib.contextmanager
def _stdin_never_read() -> Iterator[None]:
    """Swap in an empty stdin: any prompt a library might show reads end-of-file at once and
    counts as "no", instead of waiting for, or taking, an answer."""
    saved = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


def _print(
    steps: Iterator[torch.Tensor],
    n_prompts: int,
    stop_tokens: Sequence[int],
    tokenizer: Tokenizer | None,
    out: TextIO,
) -> None:
    """One prompt: its new tokens as they come; several: one line each at the end."""
    shown = ""
    generated: list[list[int]] = [[] for _ in range(n_prompts)]
    for step in steps:
        if _add(generated, step, stop_tokens) and n_prompts == 1:  # stream what it added
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


def _print_ids(
    steps: Iterator[torch.Tensor], prompts: list[list[int]], stop_tokens: Sequence[int], out: TextIO
) -> None:
    """One JSON line per prompt: its ids (as fed, unpadded) and the new ids."""
    generated: list[list[int]] = [[] for _ in prompts]
    for step in steps:
        _add(generated, step, stop_tokens)
    for prompt, new in zip(prompts, generated, strict=True):
        out.write(json.dumps({"prompt_ids": list(prompt), "new_ids": new}) + "\n")
    out.flush()


def _add(generated: list[list[int]], step: torch.Tensor, stop_tokens: Sequence[int]) -> bool:
    """A step's new ids added to each prompt's that has not emitted a stop token (the pad ids
    after one are dropped); whether any was."""
    added = False
    for ids, token in zip(generated, step.tolist(), strict=True):
        if not ids or ids[-1] not in stop_tokens:
            ids.append(token)
            added = True
    return added


def _load_image(path: Path, max_pixels: int | None) -> torch.Tensor:
    """``load_image``, its errors naming ``--image``; Pillow's DecompressionBombWarning is
    never printed (the pixel cap is checked from the header instead)."""
    with warnings.catch_warnings():
        with contextlib.suppress(ImportError):
            from PIL import Image

            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return load_image(path, max_pixels=max_pixels)
        except ValueError as error:
            raise ValueError(f"--image: {error}") from None


def default_pad_id(config: dict[str, Any], vocab: int | None) -> int:
    """The left-padding id when ``--pad-id`` is not given, in transformers' order:
    ``pad_token_id`` of ``generation_config.json``, else of ``config.json``'s top level, else
    of its text config. An id outside the vocabulary (SmolVLM's published 128002 with 49280
    tokens: no model can embed it, and generation feeds pad ids back once a sequence ends) is
    treated as unset, and an unset pad id falls back to the first EOS id, as transformers'
    ``generate`` falls back; a warning (one line) names the key passed over and the id
    padding with instead. A directory that names no pad id at all pads with 0 (any id would
    do: padding is masked). Ids beyond int64 never get here: :func:`_generation_config`
    refuses them, naming the file and key."""
    skipped: tuple[str, int] | None = None  # the first pad id outside the vocabulary
    for key in _PAD_KEYS:
        ids = _as_ids(config.get(key))
        if ids and (vocab is None or 0 <= ids[0] < vocab):
            if skipped is not None:
                _warn_pad_fallback(skipped, vocab, f"{_PAD_KEYS[key]} {ids[0]}")
            return ids[0]
        if ids and skipped is None:
            skipped = (key, ids[0])
    if skipped is None:
        return 0
    eos = _as_ids(config.get("eos_token_id"))
    fallback = eos[0] if eos and (vocab is None or eos[0] < vocab) else 0
    _warn_pad_fallback(skipped, vocab, f"eos_token_id {fallback}" if fallback else "0")
    return fallback


# Where each pad id of _generation_config's merged config comes from, in transformers' order.
_PAD_KEYS = {
    "generation_pad_token_id": "generation_config.json pad_token_id",
    "pad_token_id": "config.json pad_token_id",
    "text_pad_token_id": "config.json text_config.pad_token_id",
}


def _warn_pad_fallback(skipped: tuple[str, int], vocab: int | None, fallback: str) -> None:
    """One line: which pad id was passed over, and what pads instead."""
    key, value = skipped
    warnings.warn(
        f"{_PAD_KEYS[key]} {value} lies outside the vocabulary [0, {vocab}): left-padding with "
        f"{fallback} instead (pass --pad-id to choose)",
        stacklevel=3,
    )


def _parse_ids(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"--prompt-ids: expected comma-separated integers, got {text!r}")
    negative = [i for i in ids if i < 0]
    if negative:
        parser.error(f"--prompt-ids: expected ids >= 0, got {negative[0]} in {text!r}")
    return ids


def _check_ids_in_vocab(what: str, ids: Sequence[int], vocab: int | None) -> None:
    """Before loading the weights: ids the config's vocabulary cannot embed are refused."""
    if vocab is not None:
        outside = sorted({i for i in ids if not 0 <= i < vocab})
        if outside:
            raise ValueError(
                f"{what}: ids {outside[:5]} are outside the vocabulary [0, {vocab}) of config.json"
            )


def _check_directory(directory: Path) -> None:
    """The checkpoint is a directory with a ``config.json`` and no special files (a FIFO or a
    link to a device would be read forever or block)."""
    if not directory.exists():
        raise ValueError(f"--checkpoint: {directory} does not exist")
    if not directory.is_dir():
        raise ValueError(f"--checkpoint: {directory} is not a directory")
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                mode = os.stat(entry.path).st_mode  # through links: what a reader would open
            except OSError:
                continue  # a dangling link: whoever needs the file reports it
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(entry.path, None, "not a regular file (a FIFO or device?)")
    if not (directory / "config.json").is_file():
        raise CheckpointError(
            directory / "config.json", None, "missing: not a Hugging Face model directory"
        )


def _generation_config(directory: Path) -> dict[str, Any]:
    """``generation_config.json`` over ``config.json``, for the EOS and pad ids, the vocabulary
    size and the maximum length (the loader checks the rest of ``config.json``).

    Raises:
        CheckpointError: naming the file (and key): unreadable, too large, not a JSON object,
            or ``eos_token_id`` / ``pad_token_id`` not an id or a list of ids.
    """
    config: dict[str, Any] = {}
    for name in ("config.json", "generation_config.json"):
        file = directory / name
        if not file.exists():
            continue
        raw = read_bounded(file, _MAX_JSON_BYTES)
        try:
            content = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as error:  # ValueError: bad UTF-8 or JSON
            raise CheckpointError(file, None, f"unreadable: {_one_line(str(error))}") from error
        if not isinstance(content, dict):
            raise CheckpointError(file, None, "expected a JSON object")
        ids: dict[str, Any] = {}
        text = content.get("text_config")  # vision-language configs keep these there
        if name == "config.json" and isinstance(text, dict):
            ids["text_config.pad_token_id"] = text.get("pad_token_id")
            content = {**{k: text.get(k) for k in _TEXT_KEYS if k != "pad_token_id"}, **content}
            content["text_pad_token_id"] = text.get("pad_token_id")
        ids |= {key: content.get(key) for key in ("eos_token_id", "pad_token_id")}
        for key, value in ids.items():
            if value is not None and not _is_ids(value):
                raise CheckpointError(
                    file,
                    key,
                    f"expected an id in [0, 2**63) or a list of them, got {_short(value)}",
                )
        if name == "generation_config.json":
            content["generation_pad_token_id"] = content.get("pad_token_id")
        config |= {k: v for k, v in content.items() if v is not None}
    return config


_TEXT_KEYS = ("vocab_size", "eos_token_id", "pad_token_id", "max_position_embeddings")


def _is_ids(value: Any) -> bool:
    # Not bool, not float; and int64, as token ids are (10**30 names no token: refused, not
    # taken for an id outside the vocabulary).
    values = value if isinstance(value, list) else [value]
    return all(type(v) is int and 0 <= v < 2**63 for v in values)


def _positive_int_or_none(value: Any) -> int | None:
    """A config number used for early checks only; anything odd is left to the loader."""
    return value if type(value) is int and value > 0 else None


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    return () if value is None else tuple(value) if isinstance(value, list) else (value,)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _fail(message: str, status: int = 1) -> int:
    print(f"error: {_one_line(message)}", file=sys.stderr)
    return status
