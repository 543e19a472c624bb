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

Videos (models that take them: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) go the same way:
:meth:`ConversationEncoder.check_conversation` reads each clip's container header
(:func:`fusion.preprocessing.probe_video`, no frame decoded) and plans it with the
directory's video processor (the frames it keeps, their grid:
:meth:`~fusion.preprocessing.Qwen2VLVideoProcessor.plan`), so the rows a video brings, and its
text (Qwen3-VL's timestamps), are known before decoding and a sample too long for
``max_seq_len`` is refused or skipped with nothing decoded (:class:`VideoRef`). A video's
frames are decoded (only those kept) and patched when its batch is collated, one clip at a
time, in the data loader's workers.
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fusion._validation import check_int
from fusion.data.chat_template import (
    GENERATION_END,
    GENERATION_START,
    ChatTemplate,
)
from fusion.data.conversations import Conversation, load_conversation_image
from fusion.data.records import ConversationVideo, video_name
from fusion.data.sample import IGNORE_INDEX, ImageRef, Sample, VideoRef
from fusion.hf.files import MAX_TOKENIZER_BYTES as MAX_TOKENIZER_BYTES
from fusion.hf.files import read_tokenizer
from fusion.labels import shift_targets

if TYPE_CHECKING:
    from fusion.checkpoint.hf_model import HfDirectory

IMAGE_MARKER = "<image>"  # what the conversation files mark images with
TOKENIZER_FILE = "tokenizer.json"


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
        video_processor: for a model taking videos, its video processor
            (:class:`~fusion.preprocessing.Qwen2VLVideoProcessor` or
            :class:`~fusion.preprocessing.Qwen3VLVideoProcessor`); None: conversations with
            videos are refused.
        video_token_id: the id the video processor's ``placeholder`` (``<|video_pad|>``)
            tokenizes to (required with ``video_processor``); never a target.
        video_bounds: the largest clips read (:class:`~fusion.preprocessing.VideoBounds`;
            None: its defaults).

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
        video_processor: Any = None,
        video_token_id: int | None = None,
        video_bounds: Any = None,
    ) -> None:
        if video_processor is not None:
            if processor is None:
                raise ValueError(
                    "video_processor: given for a text-only model (processor None), got "
                    f"{type(video_processor).__name__}"
                )
            check_int(video_token_id, "video_token_id", low=0)
        if video_bounds is not None:
            from fusion.preprocessing import VideoBounds

            if not isinstance(video_bounds, VideoBounds):
                raise TypeError(
                    f"video_bounds: expected a VideoBounds or None, got "
                    f"{type(video_bounds).__name__}"
                )
        self.template = template
        self.tokenizer = tokenizer
        self.processor = processor
        self.placeholder_ids = tuple(int(i) for i in placeholder_ids)
        self.video_processor = video_processor
        self.video_token_id = video_token_id
        self.video_bounds = video_bounds
        if video_token_id is not None and video_token_id not in self.placeholder_ids:
            self.placeholder_ids += (int(video_token_id),)

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
        if hf.family.takes_videos and encoder.processor is not None:
            from fusion.preprocessing import read_video_processor

            # The model's own placeholder id (its family read and checked it from config.json).
            video_id = hf.spec.options.get("video_token_id")
            if video_id is not None:
                encoder.video_processor = read_video_processor(hf.path)
                encoder.video_token_id = video_id
                encoder.placeholder_ids += (video_id,)
        return encoder

    def encode(
        self,
        messages: Sequence[dict[str, Any]],
        images: Sequence[object] = (),
        source: str = "",
        videos: Sequence[Any] = (),
    ) -> Sample:
        """One conversation -> a :class:`Sample` with its pixels.

        Args:
            messages: Hugging Face messages (a :class:`Conversation`'s).
            images: decoded images in order of appearance (uint8 tensors [c, h, w] or Pillow
                images).
            source: where it comes from, kept in the sample.
            videos: decoded videos in order of appearance
                (:class:`~fusion.preprocessing.Video`, e.g. from
                :func:`~fusion.preprocessing.load_video` with the video processor's
                ``sampler``).

        Raises:
            ChatTemplateError: the template fails or renders no assistant turn.
            ValueError: images that do not match the image markers of the rendered text,
                images for a text-only model, an image the processor cannot take, no target
                token left (e.g. an empty answer); videos for a model taking none, or that do
                not match the video items.
            RuntimeError: a ``processor`` whose ``encode`` is not this encoder's.
        """
        from fusion.media.images import image_size
        from fusion.preprocessing import Video

        if self.processor is None and images:
            raise ValueError(
                f"images: {len(images)} given, but the model is text-only (no processor)"
            )
        self._check_takes_videos(len(videos))
        refs = []
        for i, video in enumerate(videos):
            if not isinstance(video, Video):
                raise TypeError(
                    f"videos[{i}]: expected a Video (load_video), got {type(video).__name__}"
                )
            frames = video.frames
            try:
                grid = self.video_processor.grid(frames.size(0), frames.size(2), frames.size(3))
            except ValueError as error:
                raise ValueError(f"videos[{i}]: {error}") from None
            rows = grid[0] * grid[1] * grid[2] // self.video_processor.merge_size**2
            refs.append(VideoRef(Path(f"videos[{i}]"), video.metadata, grid, rows))
        sizes = [image_size(image, f"images[{i}]") for i, image in enumerate(images)]
        tokens, labels, _ = self._tokens_and_labels(messages, sizes, refs)
        if self.processor is None:
            return Sample(tokens, labels, torch.empty(0), source)
        pixel_values, grids = self._pixels(images)
        patches, video_grids, seconds = self._video_patches(videos, refs, source)
        return Sample(
            tokens,
            labels,
            pixel_values,
            source,
            image_grid_thw=grids,
            pixel_values_videos=patches,
            video_grid_thw=video_grids,
            second_per_grid_ts=seconds,
        )

    def _check_takes_videos(self, count: int) -> None:
        if count and self.video_processor is None:
            raise ValueError(
                f"videos: {count} given, but the model takes no videos (no video processor)"
            )

    def _video_patches(
        self, videos: Sequence[Any], refs: Sequence[VideoRef], source: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The videos' patches, grids and seconds per temporal patch (float32), each video
        patched on its own, its grid checked against its plan (``refs``)."""
        if not videos:
            return (
                torch.empty(0),
                torch.empty(0, 3, dtype=torch.int64),
                torch.empty(0, dtype=torch.float32),
            )
        patches, grids, seconds = [], [], []
        for video, ref in zip(videos, refs, strict=True):
            patched = self.video_processor([video])
            grid = tuple(patched.video_grid_thw[0].tolist())
            if grid != ref.grid:  # the plan decides the grid; a guard all the same
                raise ValueError(
                    f"{source}: video {ref.name!r} gave the grid {list(grid)}, planned "
                    f"{list(ref.grid)}"
                )
            patches.append(patched.pixel_values_videos)
            grids.append(patched.video_grid_thw)
            seconds += patched.second_per_grid_ts
        return torch.cat(patches), torch.cat(grids), torch.tensor(seconds, dtype=torch.float32)

    def _tokens_and_labels(
        self,
        messages: Sequence[dict[str, Any]],
        sizes: Sequence[tuple[int, int]],
        videos: Sequence[VideoRef] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Ids, labels and each image's tiles, from the images' (height, width) alone: the
        image markers expanded as the processor expands them
        (:meth:`VisionLanguageProcessor.expand`, every cap of its ``plan`` checked), each
        video's ``<|video_pad|>`` replaced by its text from its plan alone (the video
        processor's ``video_text``), the text tokenized whole, and its placeholder ids
        counted (:meth:`VisionLanguageProcessor.check_placeholder_count`; the video ids
        against the videos' rows)."""
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
            if self.video_processor is not None:  # each <|video_pad|>: its video's text
                from fusion.preprocessing import expand_video_pads

                texts = [self.video_processor.video_text(v.grid, v.metadata) for v in videos]
                [expanded] = expand_video_pads([expanded], texts)
            # As the processor's apply_chat_template: special tokens unless the text has BOS.
            add_special = not self._starts_with_bos(rendered.text)
            ids, offsets, spans = _tokenize(
                self.tokenizer, expanded, add_special_tokens=add_special
            )
            if not ids:
                raise ValueError("prompts[0]: the tokenizer gives no tokens")
            rows = sum(tiles) * processor.tokens_per_image
            processor.check_placeholder_count([ids], rows, "prompt holds")
            if self.video_token_id is not None:
                found, rows = ids.count(self.video_token_id), sum(v.rows for v in videos)
                if found != rows:
                    raise ValueError(
                        f"prompts: the tokenized prompt holds {found} video placeholder ids "
                        f"({self.video_token_id}), but its videos give {rows} rows; the "
                        f"tokenizer must encode {self.video_processor.placeholder!r} as the "
                        f"single token {self.video_token_id}, and prompts must not hold it "
                        "otherwise"
                    )
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
        dropped at once) and only its path and size are kept; each video's container is
        probed and its frames planned (:meth:`plan_video`), none decoded; ids and labels are
        :meth:`encode`'s. Errors become a :class:`DataError` naming its file and line."""
        if self.processor is None and conversation.images:
            raise conversation.error(
                f"images: {len(conversation.images)} given, but the model is text-only "
                "(no processor)"
            )
        try:
            self._check_takes_videos(len(conversation.videos))
            videos = tuple(self.plan_video(video) for video in conversation.videos)
            sizes = []
            for path in conversation.images:
                image = load_conversation_image(path)  # decodable? (freed on the next line)
                sizes.append((image.size(1), image.size(2)))
                del image
            tokens, labels, tiles = self._tokens_and_labels(conversation.messages, sizes, videos)
        except (ValueError, OSError) as error:
            raise conversation.error(str(error)) from None
        refs = tuple(
            ImageRef(str(path), h, w, n, None if isinstance(path, Path) else path)
            for path, (h, w), n in zip(conversation.images, sizes, tiles, strict=True)
        )
        return Sample(
            tokens, labels, torch.empty(0), conversation.source, images=refs, videos=videos
        )

    def plan_video(self, video: ConversationVideo) -> VideoRef:
        """A video's :class:`VideoRef` from its container alone
        (:func:`~fusion.preprocessing.probe_video`: the header read and checked against
        :attr:`video_bounds`, packets listed, no frame decoded): the frames the video
        processor keeps, their grid and rows.

        Raises:
            ImportError: a clip file without PyAV (naming the ``video`` extra).
            ValueError: naming the clip: no video processor; not a video, truncated, past
                the bounds (:class:`~fusion.preprocessing.VideoError`); frames the processor
                cannot take; kept frames past the bounds' ``max_decoded_bytes``.
        """
        from fusion.preprocessing import VideoBounds, VideoError, probe_video

        self._check_takes_videos(1)
        processor = self.video_processor
        bounds = self.video_bounds or VideoBounds()
        name = video_name(video)
        source = video if isinstance(video, Path) else list(video)
        metadata = probe_video(source, bounds=bounds)
        try:
            indices, grid = processor.plan(metadata)
        except ValueError as error:
            raise VideoError(name, str(error)) from None
        size = len(indices) * 3 * metadata.height * metadata.width
        if size > bounds.max_decoded_bytes:
            raise VideoError(
                name,
                f"{len(indices)} frames of {metadata.width} x {metadata.height} kept would take "
                f"{size} bytes decoded, more than max_decoded_bytes={bounds.max_decoded_bytes} "
                "(VideoBounds): sample fewer frames",
            )
        rows = grid[0] * grid[1] * grid[2] // processor.merge_size**2
        return VideoRef(video, replace(metadata, frames_indices=tuple(indices)), grid, rows)

    def load_video(self, ref: VideoRef) -> Any:
        """A planned video decoded (:func:`~fusion.preprocessing.load_video`, the kept frames
        only), its frames checked to be the planned ones.

        Raises:
            ValueError: naming the clip: it can no longer be read, or it changed since it was
                planned (other frames kept, another size).
        """
        from fusion.preprocessing import VideoBounds, VideoError, load_video

        source = ref.source if isinstance(ref.source, Path) else list(ref.source)
        bounds = self.video_bounds or VideoBounds()
        video = load_video(source, sampler=self.video_processor.sampler, bounds=bounds)
        got, planned = video.metadata, ref.metadata
        if (got.frames_indices, got.width, got.height) != (
            planned.frames_indices,
            planned.width,
            planned.height,
        ):
            raise VideoError(
                ref.name,
                f"now keeps frames {list(got.frames_indices)[:8]} of {got.width} x {got.height} "
                f"pixels, planned {list(planned.frames_indices)[:8]} of {planned.width} x "
                f"{planned.height} when the data was checked: the file changed during the run",
            )
        return video

    def load_pixels(self, samples: Sequence[Sample]) -> list[Sample]:
        """``samples`` with the pixels of their :attr:`Sample.images` made: each image
        decoded and processed now (as :meth:`encode` would), for one batch at a time; and
        the patches of their :attr:`Sample.videos`: each clip's kept frames decoded and
        patched, one clip at a time (its frames freed before the next is decoded). Samples
        without image or video files are returned as they are.

        Raises:
            ValueError: naming the sample and file: an image or video that can no longer be
                read, or that changed since it was checked (the file was replaced).
        """
        out = []
        for sample in samples:
            if sample.pixels_loaded:
                out.append(sample)
                continue
            if sample.images and not sample.pixel_values.numel():
                sample = self._load_images(sample)
            if sample.videos and not sample.pixel_values_videos.numel():
                patches, grids, seconds = [], [], []
                for ref in sample.videos:
                    try:
                        video = self.load_video(ref)
                    except ValueError as error:
                        raise ValueError(f"{sample.source}: {error}") from None
                    made = self._video_patches([video], [ref], sample.source)
                    del video  # this clip's frames, before the next is decoded
                    patches.append(made[0])
                    grids.append(made[1])
                    seconds.append(made[2])
                sample = replace(
                    sample,
                    pixel_values_videos=torch.cat(patches),
                    video_grid_thw=torch.cat(grids),
                    second_per_grid_ts=torch.cat(seconds),
                )
            out.append(sample)
        return out

    def _load_images(self, sample: Sample) -> Sample:
        """``sample`` with its images decoded and processed."""
        images = []
        for ref in sample.images:
            try:
                image = load_conversation_image(ref.path if ref.embedded is None else ref.embedded)
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
            raise ValueError(f"{sample.source}: its images gave {made} tiles, expected {expected}")
        return replace(sample, pixel_values=pixels, image_grid_thw=grids)

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
        (:func:`fusion.preprocessing.load_image`, or from a data set's bytes) and its videos
        (:meth:`plan_video`, then :meth:`load_video`); errors become a :class:`DataError`
        naming its file and line."""
        try:
            images = [load_conversation_image(path) for path in conversation.images]
            self._check_takes_videos(len(conversation.videos))
            videos = [self.load_video(self.plan_video(v)) for v in conversation.videos]
            return self.encode(conversation.messages, images, conversation.source, videos)
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
