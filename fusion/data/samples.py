"""Conversations -> training samples: token ids, loss labels and pixels, as the model's own
chat template and processor give them.

The prompt text is the checkpoint's chat template rendered (:class:`ChatTemplate`); a VLM
directory's text then goes through :class:`fusion.preprocessing.VisionLanguageProcessor`
(each image marker expanded to its placeholders, :meth:`~VisionLanguageProcessor.expand`;
the placeholder ids checked; the images processed, :meth:`~VisionLanguageProcessor.pixels`),
tokenised whole with the directory's ``tokenizer.json``. The ids are those of
transformers' ``processor.apply_chat_template(conversation, tokenize=True)`` (special tokens
added unless the text starts with the BOS token, as there) or, for a text-only directory,
``tokenizer.apply_chat_template(conversation, tokenize=True)`` (never added).

Labels cover the assistant: a token is a target when its characters overlap a span of
:meth:`ChatTemplate.render_with_spans` (the ``{% generation %}`` blocks, or each assistant
message with the end-of-turn token, never the header before it) and it is not a placeholder.

Memory: pixels are made per batch, never per data set. :func:`encode_conversations` checks
every image of the file first (decoded one at a time, so a missing, truncated or corrupt
file is refused before training, then dropped) but keeps only its path (or its place in a
data set: file, row, index) and size (:class:`ImageRef`): the placeholders an image expands to
depend on its size alone, so the ids, labels and lengths the packing plan needs are computed
from sizes (the processor's own caps applied, :meth:`VisionLanguageProcessor.plan`). A
batch's pixels are decoded (a data set's image bytes read again first) and processed when it
is collated (:meth:`ConversationEncoder.load_pixels`), exactly as the
processor makes them, and freed with the batch: memory holds the token ids of the data set
plus one batch's pixels, whatever the number of images.
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fusion._validation import check_int, describe
from fusion.data.chat_template import (
    GENERATION_END,
    GENERATION_START,
    ChatTemplate,
)
from fusion.data.conversations import Conversation, DataError, load_conversation_image
from fusion.hf.files import MAX_TOKENIZER_BYTES as MAX_TOKENIZER_BYTES
from fusion.hf.files import read_tokenizer
from fusion.labels import shift_targets

if TYPE_CHECKING:
    from fusion.checkpoint.hf_model import HfDirectory

IGNORE_INDEX = -100
IMAGE_MARKER = "<image>"  # what the conversation files mark images with
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class ImageRef:
    """An image of a sample, by file: checked and measured, its pixels not kept.

    Attributes:
        path: the image file; for an image embedded in a data set, where it is
            (``"train.parquet:row 3: images[0]"``).
        height, width: its size once decoded (EXIF orientation applied).
        tiles: how many images or tiles the processor makes of it (1 for a whole image), or
            its placeholder rows for towers taking images of any size
            (:meth:`VisionLanguageProcessor.plan`).
        embedded: for an image embedded in a data set, its place there
            (:class:`fusion.data.hf_datasets.EmbeddedImage`), read again when its pixels
            are made; None for a file.
    """

    path: str
    height: int
    width: int
    tiles: int
    embedded: Any = None


@dataclass(frozen=True)
class Sample:
    """One encoded conversation.

    Attributes:
        tokens: int64 [n], placeholders included.
        labels: int64 [n]: ``labels[t]`` is ``tokens[t + 1]`` where that token is a target,
            else :data:`IGNORE_INDEX` (always at ``t = n - 1``: a sample never predicts what
            follows it, so packed samples stay apart).
        pixel_values: float32 [tiles, 3, s, s], the images or tiles in order of their
            placeholders; ``tiles`` is 0 without images (and for text-only models), and for a
            sample whose ``images`` are not loaded yet. For towers taking images of any size:
            the images' flattened patches [n_patches, 3 * 2 * p * p].
        source: where it comes from (``"file:line"``), for messages.
        truncated: whether :func:`fit_sample` cut its end.
        images: the image files whose pixels :meth:`ConversationEncoder.load_pixels` makes
            (what :func:`encode_conversations` gives); empty when ``pixel_values`` came
            with the sample.
        image_grid_thw: for towers taking images of any size, int64 [n_images, 3], each
            image's patch grid (t, h, w) (what the vision tower and the M-RoPE positions
            need); [0, 3] for other models.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor
    source: str = ""
    truncated: bool = False
    images: tuple[ImageRef, ...] = ()
    image_grid_thw: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, 3, dtype=torch.int64)
    )

    def __post_init__(self) -> None:
        """Raises ValueError: ``tokens`` not integer ids [n] with n >= 1, ``labels`` not
        integers of the same shape, ``pixel_values`` not a floating tensor (or empty),
        ``images`` not a tuple of :class:`ImageRef`."""
        tokens, labels, pixels = self.tokens, self.labels, self.pixel_values
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dim() != 1
            or tokens.numel() == 0
            or tokens.dtype.is_floating_point
            or tokens.dtype.is_complex
            or tokens.dtype == torch.bool
        ):
            raise ValueError(f"tokens: expected integer ids [n], n >= 1, got {_describe(tokens)}")
        if (
            not isinstance(labels, torch.Tensor)
            or labels.shape != tokens.shape
            or labels.dtype.is_floating_point
            or labels.dtype.is_complex
            or labels.dtype == torch.bool
        ):
            raise ValueError(
                f"labels: expected integers of the tokens' shape {list(tokens.shape)}, got "
                f"{_describe(labels)}"
            )
        if not isinstance(pixels, torch.Tensor) or (
            pixels.numel() and not pixels.dtype.is_floating_point
        ):
            raise ValueError(f"pixel_values: expected a floating tensor, got {_describe(pixels)}")
        grids = self.image_grid_thw
        if (
            not isinstance(grids, torch.Tensor)
            or grids.dim() != 2
            or grids.size(1) != 3
            or grids.dtype != torch.int64
        ):
            raise ValueError(
                f"image_grid_thw: expected int64 [n_images, 3], got {_describe(grids)}"
            )
        if not isinstance(self.images, tuple) or not all(
            isinstance(ref, ImageRef) for ref in self.images
        ):
            raise ValueError(
                f"images: expected a tuple of ImageRef, got {type(self.images).__name__}"
            )

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def has_images(self) -> bool:
        """Whether the sample shows images (loaded or not)."""
        return bool(self.images) or self.pixel_values.numel() > 0

    @property
    def pixels_loaded(self) -> bool:
        """False for a sample with images whose pixels are still to be made."""
        return not self.images or self.pixel_values.numel() > 0

    @property
    def num_targets(self) -> int:
        """How many tokens the loss covers."""
        return int((self.labels != IGNORE_INDEX).sum())


class ConversationEncoder:
    """Encodes conversations for one model directory.

    Args:
        template: the chat template.
        tokenizer: a ``tokenizers.Tokenizer`` (the directory's ``tokenizer.json``).
        processor: for a vision-language model, a :class:`VisionLanguageProcessor` whose
            ``encode`` is this encoder's :meth:`tokenize_prompt` (build it with
            :meth:`from_directory`), so prompts it prepares are tokenized as training's; None
            for a text-only model (then a conversation with images is refused).
        placeholder_ids: ids that are never targets (the image token).

    Encoding holds no state: every method is a function of its arguments and the encoder's
    attributes, which it never writes, so one encoder serves several threads at once.
    """

    def __init__(
        self,
        template: ChatTemplate,
        tokenizer: Any,
        *,
        processor: Any = None,
        placeholder_ids: Sequence[int] = (),
    ) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.processor = processor
        self.placeholder_ids = tuple(int(i) for i in placeholder_ids)

    @classmethod
    def from_directory(
        cls,
        directory: "str | os.PathLike | HfDirectory",
        *,
        template_variables: Mapping[str, Any] | None = None,
    ) -> "ConversationEncoder":
        """For a directory of any registered family (or its
        :class:`~fusion.checkpoint.hf_model.HfDirectory`, whose parsed ``config.json`` is used as it
        is): its chat template (:meth:`ChatTemplate.from_directory`, rendering with
        ``template_variables``, e.g. Qwen3.5's ``{"enable_thinking": False}``),
        ``tokenizer.json`` and, for a family with a processor, its processor
        (:meth:`VisionLanguageProcessor.from_directory`).

        Raises:
            TypeError, ValueError: ``template_variables`` that are not a mapping of
                identifiers to JSON data (before any file is read).
            CheckpointError: no or an unreadable ``tokenizer.json``, a bad ``config.json`` or
                processor config.
            ChatTemplateError: no template, or one that does not compile.
            ImportError: ``tokenizers`` or ``jinja2`` missing.
        """
        from fusion.checkpoint.hf_model import HfDirectory
        from fusion.preprocessing import VisionLanguageProcessor

        hf = HfDirectory.of(directory, "directory")
        template = ChatTemplate.from_directory(hf.path, variables=template_variables)
        tokenizer = read_tokenizer(
            hf.path / TOKENIZER_FILE, missing="encoding conversations needs the tokenizer"
        )
        encoder = cls(template, tokenizer)
        if hf.family.processor is not None:
            processor = VisionLanguageProcessor.from_directory(hf, encode=encoder.tokenize_prompt)
            encoder.processor = processor
            encoder.placeholder_ids = (processor.image_token_id,)
        return encoder

    def encode(
        self, messages: Sequence[dict[str, Any]], images: Sequence[object] = (), source: str = ""
    ) -> Sample:
        """One conversation -> a :class:`Sample` with its pixels.

        Args:
            messages: Hugging Face messages (a :class:`Conversation`'s).
            images: decoded images in order of appearance (uint8 tensors [c, h, w] or Pillow
                images).
            source: where it comes from, kept in the sample.

        Raises:
            ChatTemplateError: the template fails or renders no assistant turn.
            ValueError: images that do not match the image markers of the rendered text,
                images for a text-only model, an image the processor cannot take, no target
                token left (e.g. an empty answer).
            RuntimeError: a ``processor`` whose ``encode`` is not this encoder's.
        """
        from fusion.media.images import image_size

        if self.processor is None and images:
            raise ValueError(
                f"images: {len(images)} given, but the model is text-only (no processor)"
            )
        sizes = [image_size(image, f"images[{i}]") for i, image in enumerate(images)]
        tokens, labels, _ = self._tokens_and_labels(messages, sizes)
        if self.processor is None:
            return Sample(tokens, labels, torch.empty(0), source)
        pixel_values, grids = self._pixels(images)
        return Sample(tokens, labels, pixel_values, source, image_grid_thw=grids)

    def _tokens_and_labels(
        self, messages: Sequence[dict[str, Any]], sizes: Sequence[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Ids, labels and each image's tiles, from the images' (height, width) alone: the
        image markers expanded as the processor expands them
        (:meth:`VisionLanguageProcessor.expand`, every cap of its ``plan`` checked), the text
        tokenized whole, and its placeholder ids counted
        (:meth:`VisionLanguageProcessor.check_placeholder_count`)."""
        rendered = self.template.render_with_spans(messages)
        text = _mark(rendered.text, rendered.spans)
        tiles: list[int] = []
        if self.processor is None:  # as the tokenizer's apply_chat_template: no special tokens
            ids, offsets, spans = _tokenize(self.tokenizer, text, add_special_tokens=False)
        else:
            processor = self.processor
            if processor.encode != self.tokenize_prompt:
                raise RuntimeError(
                    "processor: its encode is not this encoder's, so the prompts it prepares "
                    "are not tokenized as training's; build the encoder with "
                    "ConversationEncoder.from_directory"
                )
            # Stand-ins of each image's size that hold one byte (stride 0): plan reads sizes.
            stand_ins = [torch.zeros((), dtype=torch.uint8).expand(3, h, w) for h, w in sizes]
            [expanded], tiles = processor.expand([text], stand_ins)
            # As the processor's apply_chat_template: special tokens unless the text has BOS.
            add_special = not self._starts_with_bos(rendered.text)
            ids, offsets, spans = _tokenize(
                self.tokenizer, expanded, add_special_tokens=add_special
            )
            if not ids:
                raise ValueError("prompts[0]: the tokenizer gives no tokens")
            rows = sum(tiles) * processor.tokens_per_image
            processor.check_placeholder_count([ids], rows, "prompt holds")
        tokens = torch.tensor(ids, dtype=torch.int64)
        target = torch.zeros(len(ids), dtype=torch.bool)
        for index, (start, end) in enumerate(offsets):
            if start == end:
                continue
            target[index] = any(start < b and end > a for a, b in spans)
        if self.placeholder_ids:
            target &= ~torch.isin(tokens, torch.tensor(self.placeholder_ids))
        labels = shift_targets(torch.where(target, tokens, IGNORE_INDEX), IGNORE_INDEX)
        if not bool((labels != IGNORE_INDEX).any()):
            raise ValueError("no target token: the assistant's turns tokenize to nothing")
        return tokens, labels, tiles

    def _pixels(self, images: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor]:
        """The images processed as the processor processes them
        (:meth:`VisionLanguageProcessor.pixels`), and their grids (int64 [0, 3] for kinds
        without).

        Raises:
            ValueError: an image the image processor cannot take, or sizes the vision tower
                does not take.
        """
        pixels, grids = self.processor.pixels(images)
        return pixels, torch.empty(0, 3, dtype=torch.int64) if grids is None else grids

    def check_conversation(self, conversation: Conversation) -> Sample:
        """``conversation`` as a :class:`Sample` whose pixels are made later
        (:meth:`load_pixels`): each image is decoded to check it (one at a time, its pixels
        dropped at once) and only its path and size are kept; ids and labels are
        :meth:`encode`'s. Errors become a :class:`DataError` naming its file and line."""
        if self.processor is None and conversation.images:
            raise conversation.error(
                f"images: {len(conversation.images)} given, but the model is text-only "
                "(no processor)"
            )
        try:
            sizes = []
            for path in conversation.images:
                image = load_conversation_image(path)  # decodable? (freed on the next line)
                sizes.append((image.size(1), image.size(2)))
                del image
            tokens, labels, tiles = self._tokens_and_labels(conversation.messages, sizes)
        except (ValueError, OSError) as error:
            raise conversation.error(str(error)) from None
        refs = tuple(
            ImageRef(str(path), h, w, n, None if isinstance(path, Path) else path)
            for path, (h, w), n in zip(conversation.images, sizes, tiles, strict=True)
        )
        return Sample(tokens, labels, torch.empty(0), conversation.source, images=refs)

    def load_pixels(self, samples: Sequence[Sample]) -> list[Sample]:
        """``samples`` with the pixels of their :attr:`Sample.images` made: each image
        decoded and processed now (as :meth:`encode` would), for one batch at a time.
        Samples without image files are returned as they are.

        Raises:
            ValueError: naming the sample and file: an image that can no longer be read, or
                whose size changed since it was checked (the file was replaced).
        """
        out = []
        for sample in samples:
            if sample.pixels_loaded:
                out.append(sample)
                continue
            images = []
            for ref in sample.images:
                try:
                    image = load_conversation_image(
                        ref.path if ref.embedded is None else ref.embedded
                    )
                except ValueError as error:
                    raise ValueError(f"{sample.source}: {error}") from None
                if (image.size(1), image.size(2)) != (ref.height, ref.width):
                    raise ValueError(
                        f"{sample.source}: image {ref.path!r} is now {image.size(1)} x "
                        f"{image.size(2)} pixels, was {ref.height} x {ref.width} when the data "
                        "was checked: the file changed during the run"
                    )
                images.append(image)
            pixels, grids = self._pixels(images)
            made = self.processor.made(pixels, grids)
            expected = sum(ref.tiles for ref in sample.images)
            if made != expected:  # the size decides the tiles; a guard all the same
                raise ValueError(
                    f"{sample.source}: its images gave {made} tiles, expected {expected}"
                )
            out.append(replace(sample, pixel_values=pixels, image_grid_thw=grids))
        return out

    def _starts_with_bos(self, text: str) -> bool:
        bos = self.template.special_tokens.get("bos_token", "")
        return bool(bos) and text.startswith(bos)

    def tokenize_prompt(self, text: str) -> list[int]:
        """``text`` -> ids as the processor's ``apply_chat_template`` tokenizes a prompt:
        special tokens added unless it starts with the BOS token (the ``encode`` of this
        encoder's processor, for prompts it prepares)."""
        return _tokenize(self.tokenizer, text, not self._starts_with_bos(text))[0]

    def encode_conversation(self, conversation: Conversation) -> Sample:
        """:meth:`encode` with the conversation's images decoded
        (:func:`fusion.preprocessing.load_image`, or from a data set's bytes); errors become a
        :class:`DataError` naming its file and line."""
        try:
            images = [load_conversation_image(path) for path in conversation.images]
            return self.encode(conversation.messages, images, conversation.source)
        except (ValueError, OSError) as error:
            raise conversation.error(str(error)) from None


def _mark(text: str, spans: Sequence[tuple[int, int]]) -> str:
    out, last = [], 0
    for start, end in spans:
        out += [text[last:start], GENERATION_START, text[start:end], GENERATION_END]
        last = end
    out.append(text[last:])
    return "".join(out)


def _tokenize(
    tokenizer: Any, marked: str, add_special_tokens: bool
) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
    """Text with span markers -> its ids, each id's character offsets in the text without
    markers, and the marked spans there."""
    clean, spans = _unmark(marked)
    encoding = tokenizer.encode(clean, add_special_tokens=add_special_tokens)
    return list(encoding.ids), list(encoding.offsets), spans


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    out, spans, length, start = [], [], 0, 0
    for index, part in enumerate(marked.split(GENERATION_START)):
        head, _, tail = part.partition(GENERATION_END)
        if index == 0:
            out.append(part)
            length += len(part)
            continue
        start = length
        out += [head, tail]
        spans.append((start, start + len(head)))
        length += len(head) + len(tail)
    return "".join(out), spans


def fit_sample(
    sample: Sample,
    max_seq_len: int,
    *,
    truncate: bool = False,
    placeholder_ids: Sequence[int] = (),
) -> Sample:
    """``sample`` if it holds at most ``max_seq_len`` tokens; else, with ``truncate``, its
    first ``max_seq_len`` tokens (the answer's end cut, ``truncated=True``). A cut must keep
    every placeholder (``placeholder_ids``): its image's rows could not be placed otherwise.

    Raises:
        ValueError: too long without ``truncate``; with it, a cut that would drop
            placeholders (their images' rows could not be placed) or leave no target.
    """
    check_int(max_seq_len, "max_seq_len", low=2)
    length = len(sample)
    if length <= max_seq_len:
        return sample
    if not truncate:
        raise ValueError(
            f"{length} tokens, longer than max_seq_len={max_seq_len} (truncate cuts the answer's "
            "end)"
        )
    kept_labels = sample.labels[:max_seq_len].clone()
    kept_labels[-1] = IGNORE_INDEX  # its target was cut
    cut = sample.tokens[max_seq_len:]
    if placeholder_ids and bool(torch.isin(cut, torch.tensor(list(placeholder_ids))).any()):
        raise ValueError(
            f"{length} tokens, and cutting at max_seq_len={max_seq_len} would cut image "
            "placeholders: the prompt and images alone are too long"
        )
    if not bool((kept_labels != IGNORE_INDEX).any()):
        raise ValueError(
            f"{length} tokens, and cutting at max_seq_len={max_seq_len} leaves no answer token"
        )
    return replace(sample, tokens=sample.tokens[:max_seq_len], labels=kept_labels, truncated=True)


@dataclass(frozen=True)
class EncodedData:
    """What :func:`encode_conversations` made.

    Attributes:
        samples: the samples, in file order.
        skipped: errors of the conversations skipped (``skip_bad=True``).
        truncated: how many samples were cut (``truncate=True``).
    """

    samples: list[Sample]
    skipped: list[DataError] = field(default_factory=list)
    truncated: int = 0


def encode_conversations(
    encoder: ConversationEncoder,
    conversations: Sequence[Conversation],
    *,
    max_seq_len: int,
    truncate: bool = False,
    skip_bad: bool = False,
) -> EncodedData:
    """Encode every conversation and fit it to ``max_seq_len`` (:func:`fit_sample`), before
    any training: the first failure is a :class:`DataError` naming the file, line and
    problem, or with ``skip_bad`` the conversation is skipped and its error kept.

    Every image is decoded once here to check it, but no pixels are kept: the samples hold
    :class:`ImageRef` (path, size, tiles) and :meth:`ConversationEncoder.load_pixels` makes
    a batch's pixels when it is collated (:meth:`ConversationEncoder.check_conversation`).

    Raises:
        ValueError: ``max_seq_len`` not an integer >= 2 (before any conversation).
        DataError: a conversation that cannot be encoded or fitted (unless ``skip_bad``), or
            no sample left.
    """
    check_int(max_seq_len, "max_seq_len", low=2)
    samples, skipped, truncated = [], [], 0
    for conversation in conversations:
        try:
            sample = encoder.check_conversation(conversation)
            sample = fit_sample(
                sample, max_seq_len, truncate=truncate, placeholder_ids=encoder.placeholder_ids
            )
        except ValueError as error:
            bad = error if isinstance(error, DataError) else conversation.error(str(error))
            if not skip_bad:
                raise bad from None
            skipped.append(bad)
            continue
        truncated += sample.truncated
        samples.append(sample)
    if not samples and conversations:
        raise DataError(
            conversations[0].file, None, f"no usable conversation (first: {skipped[0]})"
        )
    return EncodedData(samples, skipped, truncated)


def _describe(value: object) -> str:
    return describe(value) if isinstance(value, torch.Tensor) else type(value).__name__
