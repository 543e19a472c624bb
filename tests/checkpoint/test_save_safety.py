"""Saves that fail or crash half-way, links planted in the target, non-UTF-8 directory names."""

import errno
import os

import pytest
import torch

from fusion.checkpoint import (
    CheckpointError,
    load_hf_llama,
    load_state_dict,
    save_hf_llama,
    save_state_dict,
)
from fusion.checkpoint import files as checkpoint_files
from helpers import build_tiny_decoder


def sample_state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(16, 8, generator=g),
        "b.weight": torch.randn(40, generator=g).to(torch.bfloat16),
        "c.index": torch.randint(0, 9, (3, 5), generator=g),
    }


def assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype and torch.equal(actual[key], tensor), key


def snapshot(directory) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


def fail_writes_after(monkeypatch, successes: int) -> None:
    """Make the safetensors writer fail (disk full) after ``successes`` files; the failing call
    has written its file first, as a write cut short would leave it."""
    real, calls = checkpoint_files.save_file, []

    def flaky(tensors, filename, *args, **kwargs):
        calls.append(filename)
        real(tensors, filename, *args, **kwargs)
        if len(calls) > successes:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(checkpoint_files, "save_file", flaky)


def fail_call(monkeypatch, module, name: str, at: int) -> None:
    """Make ``module.name`` raise on its ``at``-th call (0-based), as a crash there would stop."""
    real, calls = getattr(module, name), []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == at + 1:
            raise OSError(errno.EIO, f"injected failure of {name} call {at}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)


class TestFailedSaveKeepsTheOldCheckpoint:
    def test_state_dict_overwrite_failing_after_the_first_shard(self, tmp_path, monkeypatch):
        old, new = sample_state_dict(0), sample_state_dict(1)
        save_state_dict(old, tmp_path, max_shard_size=600)
        before = snapshot(tmp_path)
        fail_writes_after(monkeypatch, 1)
        with pytest.raises(OSError, match="injected"):
            save_state_dict(new, tmp_path, max_shard_size=600, overwrite=True)
        assert snapshot(tmp_path) == before  # untouched, and no leftover
        assert_same(load_state_dict(tmp_path), old)
        monkeypatch.undo()
        save_state_dict(new, tmp_path, max_shard_size=600, overwrite=True)
        assert_same(load_state_dict(tmp_path), new)

    def test_hf_overwrite_failing_before_config(self, tmp_path, monkeypatch):
        old = build_tiny_decoder(seed=0)
        save_hf_llama(old, tmp_path)
        before = snapshot(tmp_path)
        fail_call(monkeypatch, checkpoint_files, "_write_bytes", 0)  # config.json's write
        with pytest.raises(OSError, match="injected"):
            save_hf_llama(build_tiny_decoder(seed=1), tmp_path, overwrite=True)
        assert snapshot(tmp_path) == before
        assert_same(load_hf_llama(tmp_path).state_dict(), old.state_dict())

    @pytest.mark.parametrize("max_shard_size", [None, 600])
    def test_a_failed_first_save_does_not_block_the_retry(
        self, tmp_path, monkeypatch, max_shard_size
    ):
        fail_writes_after(monkeypatch, 0 if max_shard_size is None else 1)
        with pytest.raises(OSError, match="injected"):
            save_state_dict(sample_state_dict(0), tmp_path, max_shard_size=max_shard_size)
        assert list(tmp_path.iterdir()) == []
        monkeypatch.undo()
        save_state_dict(sample_state_dict(0), tmp_path, max_shard_size=max_shard_size)
        assert_same(load_state_dict(tmp_path), sample_state_dict(0))

    def test_a_failed_file_save_leaves_nothing(self, tmp_path, monkeypatch):
        fail_writes_after(monkeypatch, 0)
        with pytest.raises(OSError, match="injected"):
            save_state_dict(sample_state_dict(0), tmp_path / "w.safetensors")
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.parametrize(
        "old_shards, new_shards", [(10_000, 10_000), (None, None), (None, 10_000), (10_000, None)]
    )
    def test_every_crash_point_of_the_commit_leaves_a_loadable_checkpoint(
        self, tmp_path, monkeypatch, old_shards, new_shards
    ):
        old, new = build_tiny_decoder(seed=0), build_tiny_decoder(seed=1)
        old_sd, new_sd = old.state_dict(), new.state_dict()
        outcomes, at = set(), 0
        while True:
            directory = tmp_path / f"crash{at}"
            save_hf_llama(old, directory, max_shard_size=old_shards)
            fail_call(monkeypatch, os, "replace", at)
            try:
                save_hf_llama(new, directory, max_shard_size=new_shards, overwrite=True)
                finished = True
            except OSError:
                finished = False
            monkeypatch.undo()
            loaded = load_hf_llama(directory).state_dict()
            is_old = all(torch.equal(loaded[k], v) for k, v in old_sd.items())
            assert is_old or all(torch.equal(loaded[k], v) for k, v in new_sd.items()), at
            outcomes.add("old" if is_old else "new")
            if finished:
                break
            at += 1
        assert outcomes == {"old", "new"} and at >= 2

    def test_a_crash_while_removing_stale_shards_leaves_the_new_checkpoint(
        self, tmp_path, monkeypatch
    ):
        save_hf_llama(build_tiny_decoder(seed=0), tmp_path, max_shard_size=10_000)
        new = build_tiny_decoder(seed=1)
        fail_call(monkeypatch, os, "unlink", 0)
        with pytest.raises(OSError, match="injected"):
            save_hf_llama(new, tmp_path, max_shard_size=10_000, overwrite=True)
        monkeypatch.undo()
        assert_same(load_hf_llama(tmp_path).state_dict(), new.state_dict())


class TestWriteFiles:
    """The one crash-safe writer every save goes through."""

    def test_contents_in_order_and_stale_names_removed(self, tmp_path):
        (tmp_path / "stale.bin").write_bytes(b"old")
        (tmp_path / "kept.txt").write_text("kept")
        weights = {"w": torch.arange(3.0)}
        written = checkpoint_files.write_files(
            tmp_path,
            {"a.txt": "t\u00e9xt", "b.bin": b"\x00\xff", "c.pt": lambda f: torch.save(weights, f)},
            remove=["stale.bin", "absent.bin"],
        )
        assert written == [tmp_path / "a.txt", tmp_path / "b.bin", tmp_path / "c.pt"]
        assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "t\u00e9xt"
        assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
        assert_same(load_state_dict(tmp_path / "c.pt"), weights)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.pt", "kept.txt"]

    def test_a_failed_rename_leaves_the_directory_as_it_was(self, tmp_path, monkeypatch):
        (tmp_path / "b.txt").write_text("old b")
        before = snapshot(tmp_path)
        fail_call(monkeypatch, os, "replace", 1)  # "a.txt" is renamed in, "b.txt" fails
        with pytest.raises(OSError, match="injected"):
            checkpoint_files.write_files(tmp_path, {"a.txt": "new a", "b.txt": "new b"})
        assert snapshot(tmp_path) == before

    def test_links_are_replaced_not_written_through(self, tmp_path, victim):
        directory = tmp_path / "dir"
        directory.mkdir()
        (directory / "a.txt").symlink_to(victim)
        checkpoint_files.write_files(directory, {"a.txt": "new"})
        assert_untouched(victim)
        assert not (directory / "a.txt").is_symlink()
        assert (directory / "a.txt").read_text() == "new"


@pytest.mark.parametrize(("first", "second"), [(None, 10_000), (10_000, None), (10_000, 20_000)])
def test_overwrite_changing_layout_keeps_other_files_and_no_stale_ones(tmp_path, first, second):
    (tmp_path / "tokenizer.json").write_text("{}")
    save_hf_llama(build_tiny_decoder(seed=0), tmp_path, max_shard_size=first)
    new = build_tiny_decoder(seed=1)
    written = save_hf_llama(new, tmp_path, max_shard_size=second, overwrite=True)
    assert sorted(tmp_path.iterdir()) == sorted([*written, tmp_path / "tokenizer.json"])
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    assert_same(load_hf_llama(tmp_path).state_dict(), new.state_dict())


@pytest.fixture
def victim(tmp_path):
    """A file outside the checkpoint directory that links planted in it point to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    return outside / "victim"


def assert_untouched(victim) -> None:
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


class TestPlantedLinks:
    @pytest.mark.parametrize("name", ["w.safetensors", "w.pt"])
    def test_tmp_link_next_to_a_file_target(self, tmp_path, victim, name):
        target = tmp_path / "ckpt" / name
        target.parent.mkdir()
        (target.parent / f"{name}.tmp").symlink_to(victim)
        save_state_dict(sample_state_dict(0), target)
        assert_untouched(victim)
        assert_same(load_state_dict(target), sample_state_dict(0))

    def test_tmp_links_in_a_directory_target(self, tmp_path, victim):
        directory = tmp_path / "ckpt"
        directory.mkdir()
        for name in ("model.safetensors", "model.safetensors.index.json", "config.json"):
            (directory / f"{name}.tmp").symlink_to(victim)
        for i in (1, 2, 3):
            (directory / f"model-0000{i}-of-00003.safetensors.tmp").symlink_to(victim)
        decoder = build_tiny_decoder()
        save_hf_llama(decoder, directory, max_shard_size=10_000)
        save_hf_llama(decoder, directory, overwrite=True)
        assert_untouched(victim)
        assert_same(load_hf_llama(directory).state_dict(), decoder.state_dict())

    def test_dangling_config_link(self, tmp_path, victim):
        directory = tmp_path / "ckpt"
        directory.mkdir()
        planted = victim.parent / "created-by-save.json"
        (directory / "config.json").symlink_to(planted)
        with pytest.raises(CheckpointError, match=r"config\.json: exists"):
            save_hf_llama(build_tiny_decoder(), directory)
        assert not os.path.lexists(planted) and list(directory.iterdir()) == [
            directory / "config.json"
        ]
        save_hf_llama(build_tiny_decoder(), directory, overwrite=True)
        assert not os.path.lexists(planted)
        assert not (directory / "config.json").is_symlink()
        assert_untouched(victim)

    def test_overwrite_replaces_links_instead_of_writing_through(self, tmp_path, victim):
        directory = tmp_path / "ckpt"
        directory.mkdir()
        (directory / "config.json").symlink_to(victim)
        (directory / "model.safetensors").symlink_to(victim)
        decoder = build_tiny_decoder()
        save_hf_llama(decoder, directory, overwrite=True)
        assert_untouched(victim)
        assert not (directory / "config.json").is_symlink()
        assert not (directory / "model.safetensors").is_symlink()
        assert_same(load_hf_llama(directory).state_dict(), decoder.state_dict())
        file = tmp_path / "w.safetensors"
        file.symlink_to(victim)
        save_state_dict(sample_state_dict(0), file, overwrite=True)
        assert_untouched(victim)
        assert not file.is_symlink()


@pytest.fixture
def non_utf8_dir(tmp_path) -> bytes:
    directory = os.fsencode(tmp_path) + b"/ckpt\xff"
    try:
        os.mkdir(directory)
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    return directory


class TestNonUtf8DirectoryNames:
    def test_hf_round_trip(self, non_utf8_dir):
        decoder = build_tiny_decoder()
        save_hf_llama(decoder, non_utf8_dir, max_shard_size=10_000)
        for path in (non_utf8_dir, os.fsdecode(non_utf8_dir)):
            assert_same(load_hf_llama(path).state_dict(), decoder.state_dict())

    @pytest.mark.parametrize("name", [b"w.safetensors", b"w.pt", b"sub"])
    def test_state_dict_round_trip(self, non_utf8_dir, name):
        path = non_utf8_dir + b"/" + name
        save_state_dict(sample_state_dict(0), path)
        assert_same(load_state_dict(os.fsdecode(path)), sample_state_dict(0))

    def test_errors_are_printable(self, non_utf8_dir):
        with pytest.raises(CheckpointError) as info:
            load_state_dict(non_utf8_dir)
        assert "ckpt\\xff" in str(info.value)
        str(info.value).encode("utf-8")  # would raise on a lone surrogate
