"""``python -m recipes.finetune``: check the command line and the output directory, train (or
resume), then write ``<output-dir>/final/``, ``metrics.json`` and the loss plot.

``final/`` is a Hugging Face directory of the fine-tuned model (LoRA merged) that transformers
loads; a LoRA run adds ``final/adapter/``, the adapter in PEFT's format, which
``peft.PeftModel.from_pretrained`` and vLLM load and ``--init-adapter`` continues from.
(Earlier versions wrote ``final/adapter.safetensors`` in this library's own format; one
adapter, in the format the ecosystem loads, leaves no doubt which to use.)"""

import time
from functools import partial
from pathlib import Path

from fusion import training
from fusion.training import Runtime, Start, TrainState
from recipes.finetune.config import PROG, SPEC, FinetuneConfig
from recipes.finetune.model import build_model, init_adapter_config
from recipes.finetune.trainer import TrainResult, train

FINAL = "final"
ADAPTER = "adapter"  # final/adapter/: the LoRA adapter in PEFT's format


def inspect_checkpoint(path: Path) -> TrainState:
    """The train state of checkpoint ``path`` once every file of it checks out."""
    state = training.load_train_state(path, SPEC.from_json)
    training.verify_checkpoint(path)
    return state


def export_final(config: FinetuneConfig, checkpoint: Path, output_dir: Path) -> Path:
    """``output_dir/final`` (:func:`fusion.training.export_trained`) of the model built again
    in this process alone (CPU, float32) with ``checkpoint``'s tensors: all of them, or the
    trained ones of a ``lora`` / ``projector`` run over the base of ``--model``, checked to be
    the one it trained on.

    Raises:
        TrainingError: the checkpoint does not fit the model, its base model changed, or no
            Hugging Face directory can be written for it.
    """
    assert config.model is not None
    state = training.load_train_state(checkpoint, SPEC.from_json)
    training.check_base_model(checkpoint, state, config.model)
    model = build_model(config)
    training.load_model_tensors(checkpoint, model, trainable_only=state.trainable_only)
    adapter = ADAPTER if config.train == "lora" else None
    return training.export_trained(
        model.eval(), config.model, output_dir / FINAL, peft_adapter=adapter
    )


def report(
    runtime: Runtime, start: Start[FinetuneConfig], result: TrainResult, started: float
) -> int:
    """Export ``final/`` from the last checkpoint, then write ``metrics.json`` and the plot."""
    config, output_dir = start.config, start.output_dir
    final = export_final(config, result.checkpoint, output_dir)
    training.log(runtime, f"fine-tuned model: {final}")
    steps_run = result.total_steps - result.start_step
    rate = result.tokens / result.train_seconds if result.train_seconds > 0 else 0.0
    padding = 1.0 - result.tokens / result.slots if result.slots else 0.0
    metrics = output_dir / "metrics.json"
    training.write_json(
        {
            "losses": result.losses,
            "eval_losses": [[step, loss] for step, loss in result.eval_losses],
            "steps": result.total_steps,
            "steps_run": steps_run,
            "tokens_per_second": rate,
            "tokens": result.tokens,
            "padding_fraction": padding,
            "peak_memory": training.peak_memory(runtime.device),
            "train_seconds": result.train_seconds,
            "total_seconds": time.perf_counter() - started,
            "conversations": len(result.data.samples),
            "skipped": len(result.data.skipped),
            "truncated": result.data.truncated,
            "checkpoint": str(result.checkpoint),
            "final": str(final),
        },
        metrics,
    )
    plot = training.plot_if_available(
        PROG, result.losses, output_dir / "loss.png", eval_losses=result.eval_losses,
        title=f"fine-tuning {Path(config.model or '').name} ({config.train})",
        ylabel="cross-entropy on assistant tokens",
    )  # fmt: skip
    training.log(
        runtime,
        f"trained {steps_run} steps in {result.train_seconds:.1f}s ({rate:,.0f} tokens/s, "
        f"padding {padding:.1%}); loss curve: {plot or 'none'}; metrics: {metrics}",
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the recipe; returns the exit status: 0, 1 on any error (one line on stderr), 2 on
    a bad command line (argparse's ``SystemExit``), 130 on Ctrl-C.

    Raises:
        TypeError: ``argv`` is not None or a list of str.
    """
    started = time.perf_counter()
    training.config.check_argv(argv)
    config, given = SPEC.parse_args(argv)

    def plan(runtime: Runtime) -> Start[FinetuneConfig]:
        # With --resume: the newest intact checkpoint and the configuration it stores. A new
        # run with --init-adapter takes the adapter's rank, alpha and dropout, so that its
        # checkpoints record them.
        assert config.output_dir is not None
        return training.plan_start(
            config, given, Path(config.output_dir), prog=PROG, inspect=inspect_checkpoint,
            fixed_groups=SPEC.fixed_groups, outputs=(FINAL,),
            prepare=lambda new, resume: init_adapter_config(new, given) if resume is None else new,
        )  # fmt: skip

    def run(runtime: Runtime, start: Start[FinetuneConfig]) -> TrainResult:
        return train(runtime, start, given)

    return training.run_recipe(
        PROG, config, FinetuneConfig, plan, run, partial(report, started=started)
    )
