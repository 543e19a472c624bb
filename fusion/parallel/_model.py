"""Finding the decoder inside the model a plan is applied to."""

from torch import nn

from fusion._wrappers import decoder_of
from fusion.decoder import TransformerDecoder


def find_decoder(model: nn.Module) -> TransformerDecoder:
    """``model`` itself when it is a decoder, else its ``.decoder`` (``EarlyFusion``); no
    wrapper is looked through: a plan shards the model it is given.

    Raises:
        TypeError: neither ``model`` nor ``model.decoder`` is a ``TransformerDecoder``.
    """
    decoder = decoder_of(model)
    if decoder is None:
        raise TypeError(
            "model: expected a TransformerDecoder or a model with one as .decoder (EarlyFusion), "
            f"got {type(model).__name__}"
        )
    return decoder
