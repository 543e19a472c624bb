"""Word-level tokenizer for shapes captions; the image placeholder lies outside the vocabulary."""

from collections.abc import Sequence

PAD = "<pad>"
EOS = "<eos>"
PROMPT = "describe:"


class CaptionTokenizer:
    """Maps caption words to ids and back: ``<pad>`` (0), ``<eos>``, ``describe:``, then
    ``words`` (distinct, without whitespace; else a ``ValueError``). The image placeholder id
    is ``vocab_size``, outside the text vocabulary: the decoder can never predict or embed it;
    the encoder's rows replace it."""

    def __init__(self, words: Sequence[str]) -> None:
        specials = [PAD, EOS, PROMPT]
        bad = [w for w in words if not w or w.split() != [w] or w in specials]
        if bad or len(set(words)) != len(words):
            raise ValueError(
                "words: expected distinct non-empty words without whitespace, other than "
                f"{specials}, got {list(words)}"
            )
        self.itos = [*specials, *words]
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.pad_id, self.eos_id, self.prompt_id = (self.stoi[s] for s in specials)
        self.vocab_size = self.image_id = len(self.itos)  # the image id: the first after the text's

    def encode(self, text: str) -> list[int]:
        """Ids of the words of ``text``; a ``ValueError`` names those outside the vocabulary."""
        unknown = [w for w in text.split() if w not in self.stoi]
        if unknown:
            raise ValueError(f"text: words {unknown} are not in the vocabulary, got {text!r}")
        return [self.stoi[w] for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        """Words of ``ids`` up to the first ``<eos>``; other special tokens are kept, so a
        malformed generation never decodes to a well-formed caption."""
        words = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids: expected ids in [0, {self.vocab_size}), got {i}")
            if i == self.eos_id:
                break
            words.append(self.itos[i])
        return " ".join(words)
