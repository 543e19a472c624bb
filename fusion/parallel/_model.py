"""Finding the decoder inside the model a plan is applied to."""

from torch import nn

from fusion.decoder import TransformerDecoder


def find_decoder(model: nn.Module) -> TransformerDecoder:
    """``model`` itself when it is a decoder, else its ``.decoder`` (``EarlyFusion``).

    Raises:
        TypeError: neither ``model`` nor ``model.decoder`` is a ``TransformerDecoder``.
    """
    if isinstance(model, TransformerDecoder):
        return model
    decoder = getattr(model, "decoder", None)
    if isinstance(decoder, TransformerDecoder):
        return decoder
    raise TypeError(
        "model: expected a TransformerDecoder or a model with one as .decoder (EarlyFusion), "
        f"got {type(model).__name__}"
    )
