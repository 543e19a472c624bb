"""The fixture table of the family suite (``test_families.py``): for every ``config.json``
model type of every registered family (:data:`fusion.families.FAMILIES`), how to write a tiny
random directory with transformers' own classes, and the inputs both implementations are fed.

Adding a family adds one :class:`FamilyFixture` per model type to :data:`FIXTURES`, nothing
else; a registered model type without one fails ``test_every_registered_model_type_has_a_fixture``.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gemma3_helpers
import qwen_helpers
from gemma3_helpers import (
    image_text,
    tiny_hf_gemma3,
    tiny_hf_gemma3_text,
    write_gemma3_dir,
    write_gemma3_text_dir,
)
from helpers import HF_VOCAB, tiny_hf_llama
from qwen3_helpers import PATCH_WIDTH as QWEN3_PATCH_WIDTH
from qwen3_helpers import (
    tiny_hf_qwen3,
    tiny_hf_qwen3_5,
    tiny_hf_qwen3_5_text,
    write_qwen3_5_dir,
    write_qwen3_5_text_dir,
    write_qwen3_dir,
)
from qwen_helpers import image_prompt, left_pad, mm_token_type_ids, tiny_hf_qwen, write_qwen_dir
from vlm_helpers import (
    IDEFICS3_TOKENS,
    IMAGE_ID,
    LLAVA_TOKENS,
    PAD,
    TEXT_VOCAB,
    tiny_hf_idefics3,
    tiny_hf_llava,
    write_model,
)


@dataclass(frozen=True)
class Batch:
    """The same inputs for this library's model and transformers'.

    Attributes:
        ids: token ids [b, s], left-padded with the fixture's ``pad_id`` where
            ``attention_mask`` is given.
        ours: our model's ``encoder_input`` (empty: text only).
        theirs: transformers' keyword arguments besides ``input_ids`` and ``attention_mask``.
        attention_mask: [b, s], 0 at padding (None: no padding).
    """

    ids: torch.Tensor
    ours: dict = field(default_factory=dict)
    theirs: dict = field(default_factory=dict)
    attention_mask: torch.Tensor | None = None

    @property
    def has_images(self) -> bool:
        return bool(self.ours)

    @torch.no_grad()
    def our_logits(self, model: nn.Module) -> torch.Tensor:
        assert self.attention_mask is None  # fusion's left padding takes a mask and positions
        return model(self.ids, encoder_input=self.ours) if self.ours else model(self.ids)

    @torch.no_grad()
    def their_logits(self, hf: nn.Module) -> torch.Tensor:
        return hf(input_ids=self.ids, attention_mask=self.attention_mask, **self.theirs).logits


@dataclass(frozen=True)
class FamilyFixture:
    """One model type's entry in :data:`FIXTURES`.

    Attributes:
        family: the registry name of the family that reads the model type.
        make: transformers' random model of this type, fp32, in eval mode.
        cases: named inputs the logits test runs on (those with images first).
        prompts: a left-padded batch for greedy generation (images in some samples).
        pad_id: the padding id of ``prompts``.
        causal_lm: transformers loads it with ``AutoModelForCausalLM`` (else
            ``AutoModelForImageTextToText``).
        saved_as: the model type ``save_hf_model`` and ``export_hf`` write for it, where not
            its own (the model does not tell which it came from).
        recipe_dir: writes a whole directory of this model type into the given one, as the
            fine-tuning recipe reads it (weights, tokenizer, chat template, processor
            settings); returns it. Required where the recipe can take the model (a text-only
            family, or one with a processor).
        image_size: (height, width) of the images of the recipe's conversations; None: text.
        their_images: transformers' image keyword arguments for one of our samples (its
            ``pixel_values`` and ``image_grid_thw``) and the model's config.
    """

    family: str
    make: Callable[[], nn.Module]
    cases: Mapping[str, Callable[[], Batch]]
    prompts: Callable[[], Batch]
    recipe_dir: Callable[[Path], Path] | None = None
    pad_id: int = PAD
    causal_lm: bool = False
    saved_as: str | None = None
    image_size: tuple[int, int] | None = None
    their_images: Callable[[Any, Any], dict] = lambda sample, config: {}

    def write(self, directory: Path) -> nn.Module:
        """Write the tiny random directory with transformers' ``save_pretrained``; returns the
        model written."""
        model = self.make()
        model.save_pretrained(directory)
        return model

    def auto_class(self):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        return AutoModelForCausalLM if self.causal_lm else AutoModelForImageTextToText


# ---------------------------------------------------------------------- Llama


def text_case(vocab: int, length: int = 12) -> Callable[[], Batch]:
    """Two rows of random ids in [4, vocab) (no special id)."""

    def case() -> Batch:
        generator = torch.Generator().manual_seed(0)
        return Batch(torch.randint(4, vocab, (2, length), generator=generator))

    return case


def text_prompts(vocab: int) -> Callable[[], Batch]:
    """Two prompts of 4 and 7 random ids, the first left-padded."""

    def prompts() -> Batch:
        generator = torch.Generator().manual_seed(1)
        short, long = (torch.randint(4, vocab, (n,), generator=generator).tolist() for n in (4, 7))
        ids = torch.tensor([[PAD] * (len(long) - len(short)) + short, long])
        return Batch(ids, attention_mask=(ids != PAD).long())

    return prompts


# ---------------------------------------------------------------------- Gemma 3 (text)


def gemma3_text() -> Batch:
    """Longer than the sliding window: the sliding layers see part of each row only."""
    generator = torch.Generator().manual_seed(0)
    return Batch(torch.randint(3, gemma3_helpers.VOCAB, (2, 14), generator=generator))


def gemma3_text_prompts() -> Batch:
    """A left-padded batch whose long prompt outgrows the window before decoding starts."""
    generator = torch.Generator().manual_seed(1)
    lengths = (3, gemma3_helpers.WINDOW + 4)
    short, long = (
        torch.randint(3, gemma3_helpers.VOCAB, (n,), generator=generator) for n in lengths
    )
    ids = torch.stack([torch.cat([torch.full((len(long) - len(short),), PAD), short]), long])
    return Batch(ids, attention_mask=(ids != PAD).long())


def gemma3_batch(ids: torch.Tensor, images: int, seed: int, attention_mask=None) -> Batch:
    """``ids`` with ``images`` random images; transformers is given the ``token_type_ids``
    its processor writes (1 at the placeholders), without which it attends causally."""
    generator = torch.Generator().manual_seed(seed)
    size = gemma3_helpers.IMAGE_SIZE
    pixels = torch.randn(images, 3, size, size, generator=generator)
    types = (ids == gemma3_helpers.IMAGE).long()
    return Batch(
        ids,
        {"image": {"pixel_values": pixels}},
        {"pixel_values": pixels, "token_type_ids": types},
        attention_mask,
    )


def gemma3_images() -> Batch:
    """Two samples of the same length: one image in the first, two in the second, each run
    of placeholders longer than the sliding window."""
    generator = torch.Generator().manual_seed(0)
    one, two = image_text(1), image_text(2)
    ids = torch.randint(3, gemma3_helpers.BOI, (2, len(two) + 8), generator=generator)
    ids[0, 3 : 3 + len(one)] = torch.tensor(one)
    ids[1, 1 : 1 + len(two)] = torch.tensor(two)
    return gemma3_batch(ids, 3, seed=1)


def gemma3_vision_text() -> Batch:
    """Text only: no image ids."""
    generator = torch.Generator().manual_seed(0)
    return Batch(torch.randint(3, gemma3_helpers.BOI, (2, 14), generator=generator))


def gemma3_prompts() -> Batch:
    """A left-padded batch with images: one in the short prompt, two in the long one."""
    short = [2, 9, *image_text(1), 20, 30]
    long = [2, *image_text(1), 11, 12, *image_text(1), 13, 14, 15]
    ids = torch.tensor([[PAD] * (len(long) - len(short)) + short, long])
    return gemma3_batch(ids, 3, seed=3, attention_mask=(ids != PAD).long())


# ---------------------------------------------------------------------- LLaVA


def llava_images() -> Batch:
    """Two samples of the same length: one image in the first, two in the second."""
    generator = torch.Generator().manual_seed(0)
    rows = LLAVA_TOKENS
    tokens = torch.randint(8, TEXT_VOCAB, (2, 3 * rows + 6), generator=generator)
    tokens[:, 0] = 1
    tokens[0, 3 : 3 + rows] = IMAGE_ID
    tokens[1, 1 : 1 + rows] = IMAGE_ID
    tokens[1, 4 + rows : 4 + 2 * rows] = IMAGE_ID
    pixels = torch.randn(3, 3, 16, 16, generator=generator)
    return Batch(tokens, {"image": {"pixel_values": pixels}}, {"pixel_values": pixels})


def llava_prompts() -> Batch:
    generator = torch.Generator().manual_seed(3)
    rows = LLAVA_TOKENS
    short = [1, 9, *[IMAGE_ID] * rows, 20, 30]
    long = [1, *[IMAGE_ID] * rows, 11, 12, *[IMAGE_ID] * rows, 13, 14, 15]
    ids = torch.tensor([[PAD] * (len(long) - len(short)) + short, long])
    pixels = torch.randn(3, 3, 16, 16, generator=generator)
    return Batch(
        ids, {"image": {"pixel_values": pixels}}, {"pixel_values": pixels}, (ids != PAD).long()
    )


def vlm_text() -> Batch:
    """Text only, no placeholder: the LLaVA and Idefics3 tokenizers' ids."""
    generator = torch.Generator().manual_seed(0)
    return Batch(torch.randint(8, TEXT_VOCAB, (2, 20), generator=generator))


# ---------------------------------------------------------------------- Idefics3 / SmolVLM

TILES = (1, 3)  # tiles of sample 0 and sample 1


def padded_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """Packed tiles -> transformers' [batch, max tiles, 3, h, w], zero tiles as padding."""
    out = torch.zeros(2, max(TILES), *tiles.shape[1:])
    out[0, : TILES[0]] = tiles[: TILES[0]]
    out[1, : TILES[1]] = tiles[TILES[0] :]
    return out


def idefics3_tiles() -> Batch:
    """Two samples of the same length, with 1 and 3 tiles' placeholders."""
    generator = torch.Generator().manual_seed(0)
    rows = IDEFICS3_TOKENS
    tokens = torch.randint(8, TEXT_VOCAB, (2, 4 * rows + 8), generator=generator)
    tokens[:, 0] = 1
    tokens[0, 5 : 5 + rows] = IMAGE_ID
    for start in (2, 3 + rows, 4 + 2 * rows):
        tokens[1, start : start + rows] = IMAGE_ID
    tiles = torch.randn(sum(TILES), 3, 16, 16, generator=generator)
    return Batch(tokens, {"image": {"pixel_values": tiles}}, {"pixel_values": padded_tiles(tiles)})


def idefics3_prompts() -> Batch:
    rows = IDEFICS3_TOKENS
    short = [1, 9, *[IMAGE_ID] * rows, 20, 30]
    long = [1, *[IMAGE_ID] * rows, 11, *[IMAGE_ID] * rows, 12, *[IMAGE_ID] * rows, 13, 14]
    ids = torch.tensor([[PAD] * (len(long) - len(short)) + short, long])
    tiles = idefics3_tiles()
    return Batch(ids, tiles.ours, tiles.theirs, (ids != PAD).long())


# ---------------------------------------------------------------------- Qwen-VL

QWEN_CASES = {
    "one-image": ([(1, 6, 10)], [3, 5]),
    "two-images": ([(1, 4, 4), (1, 10, 6)], [2, 3, 4]),  # h != w, several windows in 10 x 6
    "text": ([], [9]),
}


def qwen_batch(
    ids: torch.Tensor,
    pixels: torch.Tensor,
    grid: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> Batch:
    theirs: dict = {"mm_token_type_ids": mm_token_type_ids(ids)}
    if not len(grid):
        return Batch(ids, {}, theirs, attention_mask)
    images = {"pixel_values": pixels, "image_grid_thw": grid}
    return Batch(ids, {"image": images}, theirs | images, attention_mask)


def qwen_sample(case: str, seed: int, patch_width: int) -> tuple[torch.Tensor, ...]:
    """``qwen_helpers.image_prompt`` of ``case``, its patches ``patch_width`` wide."""
    ids, pixels, grid = image_prompt(*QWEN_CASES[case], seed=seed)
    if patch_width != pixels.size(1):
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randn(int(grid.prod(-1).sum()), patch_width, generator=generator)
    return ids, pixels, grid


def qwen_cases(patch_width: int) -> dict[str, Callable[[], Batch]]:
    return {
        case: (lambda case=case: qwen_batch(*qwen_sample(case, 0, patch_width)))
        for case in QWEN_CASES
    }


def qwen_prompts(patch_width: int) -> Callable[[], Batch]:
    def prompts() -> Batch:
        samples = [
            qwen_sample(case, seed, patch_width)
            for seed, case in enumerate(["two-images", "one-image", "text"])
        ]
        ids, attention = left_pad([s[0] for s in samples])
        pixels = torch.cat([s[1] for s in samples])
        grid = torch.cat([s[2] for s in samples])
        return qwen_batch(ids, pixels, grid, attention)

    return prompts


# ---------------------------------------------------------------------- the recipe's inputs


def llava_their_images(sample, config) -> dict:
    pixels = sample.pixel_values  # [images, 3, h, w]
    return {"pixel_values": pixels} if len(pixels) else {}


def idefics3_their_images(sample, config) -> dict:
    pixels = sample.pixel_values[None]  # [1, tiles, 3, h, w]
    return {"pixel_values": pixels} if len(sample.pixel_values) else {}


def qwen_their_images(sample, config) -> dict:
    images = {"pixel_values": sample.pixel_values, "image_grid_thw": sample.image_grid_thw}
    is_image = sample.tokens[None] == config.image_token_id
    return {"mm_token_type_ids": is_image.to(torch.int32)} | (
        images if len(sample.image_grid_thw) else {}
    )


def gemma3_their_images(sample, config) -> dict:
    # token_type_ids: without them transformers attends causally over the images
    types = (sample.tokens[None] == config.image_token_id).long()
    pixels = {"pixel_values": sample.pixel_values} if len(sample.pixel_values) else {}
    return {"token_type_ids": types} | pixels


# ---------------------------------------------------------------------- the table

FIXTURES: dict[str, FamilyFixture] = {
    "llama": FamilyFixture(
        "llama",
        lambda: tiny_hf_llama(tied=False),
        {"text": text_case(HF_VOCAB)},
        text_prompts(HF_VOCAB),
        lambda directory: write_model("llama", directory),
        causal_lm=True,
    ),
    "gemma3_text": FamilyFixture(
        "gemma3_text",
        tiny_hf_gemma3_text,
        {"text": gemma3_text},
        gemma3_text_prompts,
        write_gemma3_text_dir,
        causal_lm=True,
    ),
    "gemma3": FamilyFixture(
        "gemma3",
        tiny_hf_gemma3,
        {"images": gemma3_images, "text": gemma3_vision_text},
        gemma3_prompts,
        write_gemma3_dir,
        image_size=(24, 40),
        their_images=gemma3_their_images,
    ),
    "llava": FamilyFixture(
        "llava",
        tiny_hf_llava,
        {"images": llava_images, "text": vlm_text},
        llava_prompts,
        lambda directory: write_model("llava", directory),
        image_size=(16, 16),
        their_images=llava_their_images,
    ),
    "idefics3": FamilyFixture(
        "idefics3",
        tiny_hf_idefics3,
        {"tiles": idefics3_tiles, "text": vlm_text},
        idefics3_prompts,
        lambda directory: write_model("idefics3", directory),
        image_size=(16, 16),
        their_images=idefics3_their_images,
    ),
    "smolvlm": FamilyFixture(
        "idefics3",
        lambda: tiny_hf_idefics3(smolvlm=True),
        {"tiles": idefics3_tiles, "text": vlm_text},
        idefics3_prompts,
        lambda directory: write_model("smolvlm", directory),
        saved_as="idefics3",
        image_size=(16, 16),
        their_images=idefics3_their_images,
    ),
    **{
        model_type: FamilyFixture(
            "qwen2_vl",
            # seed 2: greedy decoding that does not settle on one token (as in
            # tests/generation/test_qwen2_vl.py)
            lambda model_type=model_type: tiny_hf_qwen(model_type, seed=2),
            qwen_cases(qwen_helpers.PATCH_WIDTH),
            qwen_prompts(qwen_helpers.PATCH_WIDTH),
            lambda directory, model_type=model_type: write_qwen_dir(directory, model_type),
            pad_id=qwen_helpers.PAD,
            image_size=(40, 60),
            their_images=qwen_their_images,
        )
        for model_type in qwen_helpers.MODEL_TYPES
    },
    "qwen3_vl": FamilyFixture(
        "qwen3_vl",
        tiny_hf_qwen3,
        qwen_cases(QWEN3_PATCH_WIDTH),
        qwen_prompts(QWEN3_PATCH_WIDTH),
        write_qwen3_dir,
        pad_id=qwen_helpers.PAD,
        image_size=(40, 60),
        their_images=qwen_their_images,
    ),
    "qwen3_5": FamilyFixture(
        "qwen3_5",
        tiny_hf_qwen3_5,
        qwen_cases(QWEN3_PATCH_WIDTH),
        qwen_prompts(QWEN3_PATCH_WIDTH),
        write_qwen3_5_dir,
        pad_id=qwen_helpers.PAD,
        image_size=(40, 60),
        their_images=qwen_their_images,
    ),
    # 70 tokens: the DeltaNet's chunked delta rule runs over more than one 64-token chunk.
    "qwen3_5_text": FamilyFixture(
        "qwen3_5_text",
        tiny_hf_qwen3_5_text,
        {"text": text_case(qwen_helpers.VOCAB, 70)},
        text_prompts(qwen_helpers.VOCAB),
        write_qwen3_5_text_dir,
        causal_lm=True,
    ),
}
