"""`fp4stack data pack|unpack`: parts of bounded size, verified reassembly, damaged parts named."""

from __future__ import annotations

import json
import lzma
import tarfile
from pathlib import Path

import pytest

from fp4stack.cli import main
from fp4stack.data import build_dataset
from fp4stack.data.pack import MIB, pack, unpack, verify

ROOT = Path(__file__).resolve().parent.parent
FILES = ("train.bin", "val.bin", "tokenizer.json", "manifest.json")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("pack")
    corpus_dir = base / "corpus"
    corpus_dir.mkdir()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        (corpus_dir / (path.stem + ".md")).write_text(path.read_text())
    return build_dataset(base / "data", [str(corpus_dir)], vocab_size=512, min_val_tokens=0,
                         val_fraction=0.1, verbose=False)


def test_round_trip_in_small_parts(data_dir, tmp_path):
    limit = 0.02  # MiB: several parts even for a small corpus
    manifest_path = pack(data_dir, tmp_path / "pack", parts_mib=limit, name="small")
    m = json.loads(manifest_path.read_text())
    parts = [tmp_path / "pack" / p["file"] for p in m["parts"]]
    assert len(parts) >= 3
    assert [p.name for p in parts] == [f"small.tar.xz.{i:03d}" for i in range(len(parts))]
    sizes = [p.stat().st_size for p in parts]
    assert all(s == int(limit * MIB) for s in sizes[:-1]) and 0 < sizes[-1] <= int(limit * MIB)
    assert sum(sizes) == m["bytes"]
    # The parts, concatenated, are an ordinary .tar.xz holding exactly the build's files.
    whole = tmp_path / "whole.tar.xz"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(whole) as tar:
        assert sorted(tar.getnames()) == sorted(FILES)
    out = unpack(tmp_path / "pack", tmp_path / "restored")
    for name in FILES:
        assert (out / name).read_bytes() == (data_dir / name).read_bytes()
    # Unpacking again replaces the earlier fp4stack build.
    assert unpack(manifest_path, tmp_path / "restored") == out


def test_damaged_missing_and_foreign_parts(data_dir, tmp_path):
    manifest_path = pack(data_dir, tmp_path / "pack", parts_mib=0.02, name="d")
    parts = sorted((tmp_path / "pack").glob("d.tar.xz.*"))
    data = bytearray(parts[1].read_bytes())
    data[100] ^= 0xFF
    parts[1].write_bytes(bytes(data))
    parts[2].write_bytes(parts[2].read_bytes()[:-10])
    parts[0].unlink()
    with pytest.raises(ValueError) as e:
        verify(manifest_path)
    msg = str(e.value)
    assert "d.tar.xz.000 is missing" in msg and "d.tar.xz.001: sha256 differs" in msg
    assert "d.tar.xz.002 has" in msg and "copy those parts again" in msg
    with pytest.raises(ValueError):
        unpack(manifest_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # Never unpacked over a folder that is not an fp4stack build.
    good = pack(data_dir, tmp_path / "good", parts_mib=1, name="g")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        unpack(good, foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    # An existing pack is not overwritten; a non-data folder is not packed.
    with pytest.raises(FileExistsError):
        pack(data_dir, tmp_path / "good", name="g")
    with pytest.raises(ValueError, match="not an fp4stack data directory"):
        pack(foreign, tmp_path / "p2")


def test_archive_with_unlisted_member_is_refused(data_dir, tmp_path):
    manifest_path = pack(data_dir, tmp_path / "pack", parts_mib=1, name="x")
    m = json.loads(manifest_path.read_text())
    # A stream whose checksums match its manifest but which holds an unexpected file.
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        tar.add(data_dir / "manifest.json", arcname="../escape.json")
    blob = lzma.compress(evil.read_bytes())
    part = tmp_path / "pack" / "x.tar.xz.000"
    for p in m["parts"]:
        (tmp_path / "pack" / p["file"]).unlink()
    part.write_bytes(blob)
    import hashlib

    digest = hashlib.sha256(blob).hexdigest()
    m.update(bytes=len(blob), sha256=digest,
             parts=[{"file": part.name, "bytes": len(blob), "sha256": digest}])
    manifest_path.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="does not list"):
        unpack(manifest_path, tmp_path / "out")
    assert not (tmp_path / "escape.json").exists() and not (tmp_path / "out").exists()


def test_cli(data_dir, tmp_path, capsys):
    assert main(["data", "pack", str(data_dir), "--out", str(tmp_path / "p"), "--parts-mib",
                 "0.1", "--preset", "1"]) == 0
    assert "part(s)" in capsys.readouterr().out
    assert main(["data", "unpack", str(tmp_path / "p"), "--out", str(tmp_path / "o"),
                 "--check"]) == 0
    assert not (tmp_path / "o").exists()
    assert main(["data", "unpack", str(tmp_path / "p"), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "train.bin").read_bytes() == (data_dir / "train.bin").read_bytes()
    assert main(["data", "unpack", str(tmp_path / "nothing"), "--out", str(tmp_path / "o2")]) == 2
    assert "no such pack manifest" in capsys.readouterr().err
    assert main(["data", "sources"]) == 0
    listing = capsys.readouterr().out
    assert "dict-gcide" in listing and "docs-mix" in listing and "GPL-3.0-or-later" in listing
