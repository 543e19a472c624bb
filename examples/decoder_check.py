"""Build a small Llama-3 decoder and check its two input paths and its KV cache.

Prints each check and exits non-zero if one fails.
"""

import sys

import torch

from fusion.models import llama3_2


def main() -> int:
    torch.manual_seed(0)
    decoder = llama3_2(
        vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=128
    ).eval()
    tokens = torch.randint(0, 256, (2, 24))
    failures = 0

    def report(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}")

    with torch.no_grad():
        logits = decoder(tokens)
        from_embeds = decoder(input_embeds=decoder.tok_embeddings(tokens))
        report(
            "forward(tokens) == forward(input_embeds=tok_embeddings(tokens))",
            torch.equal(logits, from_embeds),
            f"logits {list(logits.shape)} {logits.dtype}, bitwise equal: "
            f"{torch.equal(logits, from_embeds)}",
        )

        decoder.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=32)
        steps = [decoder(tokens[:, :8])] + [decoder(tokens[:, i : i + 1]) for i in range(8, 24)]
        error = (torch.cat(steps, dim=1) - logits).abs().max().item()
        report(
            "prefill 8 + 16 cached single-token steps == one full forward",
            error <= 1e-4,
            f"max abs difference {error:.2e} (tolerance 1e-4)",
        )
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
