"""A/B of fused_token_loss with a trained output (full fine-tuning): one chunk against
chunks, forward and backward, in fresh processes, alternating."""

import json
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = {"one chunk of 1540": (1540, True), "2 x 770": (1024, False), "4 x 385": (512, False)}


def worker(name: str) -> None:
    import torch

    import fusion.labels as labels

    torch.set_num_threads(2)
    chunk, single = VARIANTS[name]
    if not single:
        labels._one_chunk_is_leaner = lambda *a: False  # keep the chunks
    torch.manual_seed(0)
    out = torch.nn.Linear(2048, 151936, bias=False)
    hidden = torch.randn(1, 1540, 2048, requires_grad=True)
    target = torch.randint(0, 151936, (1, 1540))
    times = []
    for _ in range(3):  # one warm-up, two timed
        out.weight.grad = None
        hidden.grad = None
        start = time.perf_counter()
        total, count = labels.fused_token_loss(
            hidden, target, out, grad_scale=1 / 1540, chunk_size=chunk, num_targets=1540
        )
        (total / count).backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps({"name": name, "s": times[1:], "peak_mib": peak, "loss": float(total / count)})
    )


def main() -> None:
    names = list(VARIANTS)
    results = {n: {"s": [], "peak_mib": []} for n in names}
    for r in range(3):
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            line = (
                subprocess.run(
                    [sys.executable, __file__, name], check=True, capture_output=True, text=True
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            got = json.loads(line)
            results[name]["s"].append(min(got["s"]))
            results[name]["peak_mib"].append(got["peak_mib"])
            print(r, got, flush=True)
    for name, r in results.items():
        print(
            f"{name:20} {statistics.median(r['s']):6.2f} s [{min(r['s']):.2f}-{max(r['s']):.2f}]"
            f"  peak {statistics.median(r['peak_mib']):.0f} MiB"
        )


if __name__ == "__main__":
    worker(sys.argv[1]) if len(sys.argv) > 1 else main()
