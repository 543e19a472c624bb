"""Qwen3.5: a hybrid text stack (Gated DeltaNet and gated full attention) with Qwen3-VL's
tower without DeepStack: its builders (:mod:`.builders`) and families (:mod:`.family`); its
images are the Qwen-VL processor's."""

from fusion.families.qwen3_5.builders import qwen3_5, qwen3_5_text
from fusion.families.qwen3_5.family import QWEN3_5, QWEN3_5_TEXT

__all__ = ["QWEN3_5", "QWEN3_5_TEXT", "qwen3_5", "qwen3_5_text"]
