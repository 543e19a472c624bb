"""``fusion.checkpoint`` exports what users call; the building blocks live in their modules."""

import importlib

import fusion.checkpoint

BUILDING_BLOCKS = {
    "files": ["CheckpointFiles", "TensorEntry", "write_files"],
    "hf_config": ["hf_config_from_decoder", "llama3_2_kwargs_from_hf_config"],
    "keys": [
        "fusion_key_to_hf",
        "hf_key_to_fusion",
        "interleaved_to_rotate_half",
        "rotate_half_to_interleaved",
    ],
}


def test_building_blocks_are_importable_from_their_modules_only():
    for module, names in BUILDING_BLOCKS.items():
        found = importlib.import_module(f"fusion.checkpoint.{module}")
        for name in names:
            assert callable(getattr(found, name)), name
            assert not hasattr(fusion.checkpoint, name), name


def test_every_export_is_a_loader_saver_exporter_converter_or_the_error():
    names = fusion.checkpoint.__all__
    assert all(callable(getattr(fusion.checkpoint, name)) for name in names)
    io = [n for n in names if n.startswith(("load_", "save_", "export_"))]
    renaming = [n for n in names if "_to_" in n] + ["select_prefix", "decoder_state_dict"]
    assert sorted(names) == sorted([*io, *renaming, "CheckpointError", "read_hf_config"])
