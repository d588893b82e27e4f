"""fp4stack.files: what every writer promises (complete files, the umask's mode, no temporary
files left behind by a killed save), checked here on the token shards' writer."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fp4stack.data.shards import write_shard
from fp4stack.files import new_file_mode, publish, temp_path


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_new_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert new_file_mode() == mode
        write_shard(tmp_path / "train.bin", np.arange(10), vocab_size=300)
    finally:
        os.umask(old)
    assert (tmp_path / "train.bin").stat().st_mode & 0o777 == mode


def test_a_killed_saves_temporary_file_goes_with_the_next_save(tmp_path):
    stale = tmp_path / ".train.bin.123.abc.tmp"  # what a save killed midway leaves
    other = tmp_path / ".val.bin.123.abc.tmp"  # another file's: not this save's to remove
    stale.write_bytes(b"partial")
    other.write_bytes(b"partial")
    write_shard(tmp_path / "train.bin", np.arange(10), vocab_size=300)
    assert not stale.exists() and other.exists()
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == list(range(10))


def test_publish_renames_a_complete_file_in_one_step(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("old")
    tmp = temp_path(path)
    assert tmp.parent == tmp_path and tmp.name.startswith(".x.json.")
    tmp.write_text("new")
    publish(tmp, path)
    assert path.read_text() == "new" and not tmp.exists()


def test_an_output_directory_in_place_of_a_file_is_named(tmp_path):
    from fp4stack.files import make_output_dir

    (tmp_path / "taken").write_text("not a directory")
    for out in (tmp_path / "taken", tmp_path / "taken" / "run"):
        with pytest.raises(ValueError, match=r"taken is a file, not a directory; choose another"):
            make_output_dir(out)
    assert make_output_dir(tmp_path / "a" / "b").is_dir()
    assert (tmp_path / "taken").read_text() == "not a directory"
