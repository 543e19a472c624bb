"""A trained model as a Hugging Face directory that ``transformers`` loads on its own: weights
and ``config.json`` from this library's savers, plus the tokenizer, processor, chat-template
and generation-config files of the directory the model came from."""

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from torch import nn

from fusion._adapters import first_lora_layer
from fusion._io import FileTooLarge, NotRegularFile, read_regular
from fusion._validation import is_int
from fusion._wrappers import unwrap
from fusion.checkpoint.errors import CheckpointError, as_path, check_positive_int, short_repr
from fusion.checkpoint.files import fsync_path
from fusion.checkpoint.hf_config import CONFIG_NAME, read_hf_config
from fusion.checkpoint.hf_model import save_family
from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.families import Family, family_of

# What a model directory holds besides weights and config.json, for tokenizers, processors and
# generation (transformers' names); those present in the source are copied.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)
MAX_SIDE_FILE_BYTES = 128 * 2**20  # tokenizer.json of a large vocabulary is tens of MB
# Ids that config.json holds besides the model's shapes: the savers write a config from the
# model alone, so these are carried over from the source's config.json where it has them.
TOKEN_ID_KEYS = ("vision_start_token_id", "vision_end_token_id", "video_token_id")
TEXT_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_hf(
    model: nn.Module,
    source_dir: str | bytes | os.PathLike | None,
    out_dir: str | bytes | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_size: int | None = None,
) -> list[Path]:
    """Write ``model`` as a Hugging Face directory at ``out_dir``, with ``source_dir``'s
    tokenizer, processor, chat-template and generation-config files (:data:`SIDE_FILES`).

    The weights and ``config.json`` come from :func:`~fusion.checkpoint.save_hf_model`: the
    class ``transformers`` loads is the one of ``model``'s family (its ``architectures``,
    :data:`fusion.families.FAMILIES`). The directory is complete or
    absent: everything is written and fsynced into a new sibling directory, then renamed to
    ``out_dir``. With ``overwrite``, an existing ``out_dir`` is first renamed aside and removed
    once the new one is in place (a crash between the two renames leaves both complete beside
    ``out_dir``, never a partial ``out_dir``).

    The written ``config.json`` describes the model; the source's token ids that the model
    does not hold (:data:`TOKEN_ID_KEYS`, and the text model's :data:`TEXT_TOKEN_ID_KEYS`)
    are carried over from its ``config.json``, so that the export preprocesses and generates
    as the source did.

    The source directory is untrusted: only the names in :data:`SIDE_FILES` are read, each a
    regular file (a symbolic link is refused, not followed) of at most
    :data:`MAX_SIDE_FILE_BYTES`; nothing in them is parsed or run.

    Args:
        model: an ``EarlyFusion`` of a registered family as the loaders build it, or a text
            decoder (or an ``EarlyFusion`` without encoders over one); possibly wrapped by
            ``torch.compile``, DDP or DataParallel; unsharded, LoRA merged
            (:func:`fusion.lora.merge_lora`). Saved in its own dtype.
        source_dir: the directory the model was loaded from, or None for weights only.
        out_dir: the directory to create.
        overwrite: replace an existing ``out_dir``.
        max_shard_size: bytes per safetensors shard (then with an index); None: one file.

    Returns:
        the files in ``out_dir``, weights and config first.

    Raises:
        TypeError: arguments of the wrong type; a model none of the savers takes.
        ValueError: ``model`` still carries LoRA adapters, or as the saver raises (a modified
            architecture, sharded or meta tensors).
        CheckpointError: ``out_dir`` exists (without ``overwrite``) or is a file;
            ``source_dir`` not a directory; a side file there that is a link, not a regular
            file, or too large; a token id in its ``config.json`` that is not one. All before
            anything is written.
        OSError: the file system failed (``out_dir`` is then as it was).
    """
    out = as_path(out_dir, "out_dir")
    source = None if source_dir is None else as_path(source_dir, "source_dir")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite: expected a bool, got {type(overwrite).__name__}")
    if max_shard_size is not None:
        check_positive_int(max_shard_size, "max_shard_size")
    save = _saver(model)
    if os.path.lexists(out) and not (out.is_dir() and not out.is_symlink()):
        raise CheckpointError(out, None, "exists and is not a directory")
    if os.path.lexists(out) and not overwrite:
        raise CheckpointError(out, None, "exists; pass overwrite=True to replace it")
    side = _side_files(source) if source is not None else {}
    ids = _token_ids(source) if source is not None else {}
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", suffix=".tmp", dir=parent))
    old: Path | None = None
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0o700 would make the export private
        written = save(staging, max_shard_size)
        if ids:
            _add_token_ids(staging / CONFIG_NAME, ids)
        for name, content in side.items():
            with open(staging / name, "xb") as f:  # exclusive: no planted link written through
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
        fsync_path(staging)
        if os.path.lexists(out):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", suffix=".tmp", dir=parent))
            os.replace(out, old)  # an empty directory: replaced atomically
        os.rename(staging, out)
        fsync_path(parent)
    except BaseException:
        if old is not None and not os.path.lexists(out):
            os.replace(old, out)  # put the old directory back
            old = None
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return [out / path.name for path in written] + [out / name for name in side]


def _saver(model: object) -> Callable[[Path, int | None], list[Path]]:
    """The saver for ``model``: ``save(directory, max_shard_size)``."""
    inner = unwrap(model)
    adapted = first_lora_layer(inner) if isinstance(inner, nn.Module) else None
    if adapted is not None:
        raise ValueError(
            f"model: carries LoRA adapters ({adapted!r}, ...); merge them first "
            "with fusion.lora.merge_lora(model) (save them apart with save_adapter)"
        )
    if isinstance(inner, EarlyFusion | TransformerDecoder):
        family = family_of(inner)  # a TypeError naming the families and the encoders
        return partial(_save, family, inner)
    raise TypeError(
        "model: expected an EarlyFusion or a TransformerDecoder, possibly "
        f"wrapped by torch.compile or DDP; got {type(model).__name__}"
    )


def _save(family: Family, model: nn.Module, directory: Path, shard: int | None) -> list[Path]:
    return save_family(model, family, directory, shard, overwrite=False)


def _token_ids(source: Path) -> dict[str, dict[str, Any]]:
    """The token ids of ``source``'s config.json (:data:`TOKEN_ID_KEYS` at the top level,
    :data:`TEXT_TOKEN_ID_KEYS` of the text model, in ``text_config`` or at the top level),
    each checked: an id, a list of ids (``eos_token_id``) or null."""
    file = source / CONFIG_NAME
    if not os.path.lexists(file):
        return {}
    config = read_hf_config(file)
    text = config.get("text_config")
    text = text if isinstance(text, dict) else config
    found = {
        "top": {key: config[key] for key in TOKEN_ID_KEYS if key in config},
        "text": {key: text[key] for key in TEXT_TOKEN_ID_KEYS if key in text},
    }
    for part in found.values():
        for key, value in part.items():
            values = value if isinstance(value, list) else [value]
            if value is not None and not all(is_int(v, 0, 2**31 - 1) for v in values):
                raise CheckpointError(file, key, f"expected a token id, got {short_repr(value)}")
    return found


def _add_token_ids(config_file: Path, ids: dict[str, dict[str, Any]]) -> None:
    """Write the source's token ids into the config the saver wrote (``config_file``, in the
    staging directory), durably."""
    config = json.loads(config_file.read_text())
    config |= ids["top"]
    text = config.get("text_config")
    (text if isinstance(text, dict) else config).update(ids["text"])
    with open(config_file, "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _side_files(source: Path) -> dict[str, bytes]:
    """The :data:`SIDE_FILES` present in ``source``: name -> content, each checked."""
    if not source.is_dir():
        raise CheckpointError(source, None, "source_dir: not a directory")
    files = {}
    for name in SIDE_FILES:
        path = source / name
        if not os.path.lexists(path):
            continue
        if path.is_symlink():
            raise CheckpointError(
                path,
                None,
                "is a symbolic link: not followed (copy the directory with its links resolved, "
                "e.g. cp -rL, and export from the copy)",
            )
        try:  # no link followed: one planted since the check is refused too
            content = read_regular(path, MAX_SIDE_FILE_BYTES, follow_symlinks=False)
        except NotRegularFile:
            raise CheckpointError(path, None, "not a regular file (a FIFO, device, ...)") from None
        except FileTooLarge as error:
            if error.size is None:
                message = f"grew beyond {MAX_SIDE_FILE_BYTES} bytes: refused"
            else:
                message = f"{error.size} bytes, more than {MAX_SIDE_FILE_BYTES}: refused"
            raise CheckpointError(path, None, message) from None
        except OSError as error:
            raise CheckpointError(path, None, f"unreadable: {error.strerror}") from error
        files[name] = content
    return files
