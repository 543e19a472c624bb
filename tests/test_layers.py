"""What the low modules give every package above them: one error base, one bounded read of a
regular file, one look behind wrappers, and the mark of a LoRA-adapted layer."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import DataParallel

import fusion
from fusion._adapters import LORA_MARK, first_lora_layer
from fusion._io import FileTooLarge, NotRegularFile, read_regular
from fusion._wrappers import decoder_of, is_wrapper, unwrap
from fusion.checkpoint import CheckpointError
from fusion.data import ChatTemplateError, DataError
from fusion.errors import FusionError
from fusion.lora import apply_lora, lora_linears, merge_lora
from fusion.training import TrainingError
from helpers import build_tiny_decoder, build_tiny_fusion


@pytest.mark.parametrize(
    ("error", "other"),
    [
        (CheckpointError, ValueError),
        (DataError, ValueError),
        (ChatTemplateError, ValueError),
        (TrainingError, RuntimeError),
        (NotRegularFile, OSError),
        (FileTooLarge, OSError),
    ],
)
def test_every_error_is_a_fusion_error_and_keeps_its_base(error, other):
    assert issubclass(error, FusionError) and issubclass(error, other)
    assert fusion.FusionError is FusionError


def test_read_regular_bounds_what_it_reads(tmp_path):
    file = tmp_path / "f"
    file.write_bytes(b"x" * 10)
    assert read_regular(file, 10) == b"x" * 10
    with pytest.raises(FileTooLarge) as info:
        read_regular(file, 9)
    assert (info.value.size, info.value.limit) == (10, 9)
    with pytest.raises(NotRegularFile):
        read_regular(tmp_path, 10)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 10)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_read_regular_refuses_a_fifo_without_blocking_and_links_when_asked(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFile):
        read_regular(fifo, 10)
    (tmp_path / "target").write_bytes(b"ok")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert read_regular(tmp_path / "link", 10) == b"ok"
    with pytest.raises(OSError) as info:
        read_regular(tmp_path / "link", 10, follow_symlinks=False)
    assert not isinstance(info.value, NotRegularFile | FileTooLarge)


def test_unwrap_looks_through_compile_and_data_parallel_in_any_order():
    model = build_tiny_fusion()
    compiled = torch.compile(DataParallel(torch.compile(model, backend="eager")), backend="eager")
    assert is_wrapper(compiled) and not is_wrapper(model)
    assert unwrap(compiled) is model
    assert isinstance(unwrap(compiled, parallel=False), DataParallel)  # compile only
    container = nn.Sequential(model)
    assert unwrap(container) is container  # a container is no wrapper


def test_decoder_of():
    model = build_tiny_fusion()
    decoder = build_tiny_decoder()
    assert decoder_of(model) is model.decoder and decoder_of(decoder) is decoder
    assert decoder_of(nn.Sequential(decoder)) is None and decoder_of(DataParallel(decoder)) is None


def test_the_lora_mark_comes_with_the_adapter_and_goes_with_it():
    model = build_tiny_fusion()
    assert first_lora_layer(model) is None
    apply_lora(model, rank=2, alpha=4)
    first = next(iter(lora_linears(model)))
    assert first_lora_layer(model) == first
    assert all(LORA_MARK in layer.__dict__ for layer in lora_linears(model).values())
    merge_lora(model)
    assert first_lora_layer(model) is None


def test_exporting_needs_neither_lora_nor_dynamo():
    code = (
        "import sys, fusion.checkpoint.export, fusion.decoder_kinds, fusion.lora.peft; "
        "print(sorted(m for m in ('torch._dynamo', 'fusion.preprocessing') if m in sys.modules))"
    )
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "[]"
    code = "import sys, fusion.checkpoint.export; print('fusion.lora' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"
