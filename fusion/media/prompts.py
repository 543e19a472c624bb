"""Prompt text: each image marker replaced by the text of its image's placeholders."""

from collections.abc import Sequence


def count_markers(prompts: Sequence[str], marker: str) -> list[int]:
    """How many times ``marker`` occurs in each prompt."""
    return [prompt.count(marker) for prompt in prompts]


def check_marker_count(
    prompts: Sequence[str], images: int, marker: str = "<image>", what: str = "image"
) -> None:
    """Raise ``ValueError`` unless ``prompts`` hold ``images`` markers in all (naming both
    counts, per prompt, and ``what`` they mark); ``TypeError`` unless they are strings."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts: expected a sequence of strings, got {prompts!r:.200}")
    if not marker:
        raise ValueError("marker: expected a non-empty string")
    counts = count_markers(prompts, marker)
    if sum(counts) != images:
        raise ValueError(
            f"prompts: {sum(counts)} {what} marker(s) {marker!r} (per prompt: {counts}), but "
            f"{images} {what}(s) given; write one {marker!r} where each {what} goes"
        )


def expand_markers(
    prompts: Sequence[str],
    replacements: Sequence[str],
    marker: str = "<image>",
    what: str = "image",
) -> list[str]:
    """Replace the markers of ``prompts``, in order across prompts, by ``replacements``.

    The i-th marker (counting through the first prompt, then the second, ...) becomes
    ``replacements[i]``: one replacement per image (or video: ``what``), in the order they are
    given.

    Raises:
        TypeError: ``prompts`` not a sequence of strings.
        ValueError: an empty ``marker``, or a number of markers other than the number of
            replacements (both counts given, per prompt).
    """
    check_marker_count(prompts, len(replacements), marker, what)
    expanded, index = [], 0
    for prompt in prompts:
        pieces = prompt.split(marker)
        out = [pieces[0]]
        for piece in pieces[1:]:
            out += [replacements[index], piece]
            index += 1
        expanded.append("".join(out))
    return expanded
