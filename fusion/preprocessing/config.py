"""Where the reader of image processor configs was first defined: it is
:meth:`fusion.hf.ConfigReader.for_image_processor` now, the one config reader, and
:data:`MAX_SIDE` lives in :mod:`fusion.hf.config`; this module keeps the old import path working."""

from fusion.hf.config import MAX_SIDE, ConfigReader

__all__ = ["MAX_SIDE", "ConfigReader"]
