import pytest
import torch

from fusion import EarlyFusion
from helpers import EMBED_DIM, VOCAB, build_tiny_decoder
from recipes.captioner.vision import PatchEmbedding, VisionEncoder

IMAGE_ID = VOCAB  # outside the decoder's vocabulary


def build_encoder(seed: int = 0) -> VisionEncoder:
    torch.manual_seed(seed)
    return VisionEncoder(
        image_size=16, patch_size=4, dim=24, num_layers=2, num_heads=3, out_dim=EMBED_DIM
    )


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_output_is_packed_rows_per_image():
    encoder = build_encoder()
    out = encoder(images(3))
    assert encoder.tokens_per_image == 16
    assert out.shape == (3, 16, EMBED_DIM) and out.dtype == torch.float32


def test_images_are_encoded_independently():
    encoder = build_encoder().eval()
    batch = images(4)
    together = encoder(batch)
    alone = torch.cat([encoder(batch[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_patch_embedding_is_local_and_row_major():
    torch.manual_seed(0)
    embed = PatchEmbedding(image_size=16, patch_size=4, in_channels=3, dim=8)
    x = images(1)
    changed = x.clone()
    changed[:, :, 4:8, 12:16] += 1  # patch (row 1, column 3) -> index 1 * 4 + 3
    diff = (embed(changed) - embed(x)).abs().sum(-1)[0]
    assert diff.nonzero().flatten().tolist() == [7]


def test_projection_head_is_a_fusion_module():
    fused = EarlyFusion(  # decoder and encoders frozen: the head trains as a fusion module
        build_tiny_decoder(),
        {"image": build_encoder()},
        {"image": IMAGE_ID},
        decoder_trainable=False,
        encoders_trainable=False,
        fusion_trainable=True,
    )
    trainable = {n for n, p in fused.named_parameters() if p.requires_grad}
    assert trainable == {"encoders.image.projection.weight", "encoders.image.projection.bias"}


def test_rows_replace_placeholders_and_gradients_reach_the_encoder():
    decoder, encoder = build_tiny_decoder(), build_encoder()
    fused = EarlyFusion(
        decoder,
        {"image": encoder},
        {"image": IMAGE_ID},
        decoder_trainable=True,
        encoders_trainable=True,
    )
    text = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    placeholders = torch.full((2, 16), IMAGE_ID)
    tokens = torch.cat([placeholders, text], dim=1)  # one image per sample, then text
    batch = images(2)
    logits = fused(tokens, encoder_input={"image": {"images": batch}})
    rows = encoder(batch)
    embeds = torch.cat([rows, decoder.tok_embeddings(text)], dim=1)
    torch.testing.assert_close(logits, decoder(input_embeds=embeds), rtol=0, atol=0)
    logits.sum().backward()
    for name, param in encoder.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "bad",
    [
        torch.rand(2, 1, 16, 16),
        torch.rand(2, 3, 16, 12),
        torch.rand(3, 16, 16),
        torch.ones(1, 3, 16, 16, dtype=torch.long),
    ],
)
def test_bad_images_are_rejected(bad):
    with pytest.raises(ValueError, match=r"images: expected floating images \[n, 3, 16, 16\]"):
        build_encoder()(bad)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="image_size"):
        VisionEncoder(image_size=18, patch_size=4, dim=8, num_layers=1, num_heads=2, out_dim=8)
    with pytest.raises(ValueError, match="num_heads"):
        VisionEncoder(image_size=16, patch_size=4, dim=8, num_layers=1, num_heads=3, out_dim=8)
    with pytest.raises(ValueError, match="out_dim"):
        VisionEncoder(image_size=16, patch_size=4, dim=8, num_layers=1, num_heads=2, out_dim=0)
