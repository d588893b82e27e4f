"""Named Debian documentation and dictionary sources, read offline from small .deb files built
here with the real packages' layouts; the docs-mix; real packages only when already cached."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_data_markup import MAN, POD, b64

from fp4stack.data import build as build_module
from fp4stack.data import build_dataset, corpus
from fp4stack.data.debian_docs import DEBIAN_DOCS, DICT_DOC_CHARS, MIN_WORDS, selects

ROOT = Path(__file__).resolve().parent.parent
needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None,
                                reason="needs dpkg-deb (Debian/Ubuntu)")


def prose(n: int) -> list[str]:
    """`n` distinct paragraphs of the project's README (real English, at least 40 words)."""
    paras = [p.strip() for p in (ROOT / "README.md").read_text().split("\n\n")
             if len(p.split()) >= 40 and not p.startswith(("```", "|"))]
    assert len(paras) >= n
    return paras[:n]


def make_deb(cache: Path, package: str, files: dict[str, bytes]) -> None:
    root = cache.parent / f"build-{package}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
        "Description: test\n")
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    subprocess.run(["dpkg-deb", "--build", "-Zgzip", str(root),
                    str(cache / f"{package}_1.0_all.deb")], check=True, capture_output=True)


def read(name: str, cache: Path) -> list[corpus.Document]:
    src = corpus.SOURCES[name]
    return list(src.read(src.fetch(cache)))


def dict_entries() -> list[tuple[str, str]]:
    p = prose(6)
    return [(f"word{i:03d}", f"word{i:03d}\n   n. {p[i % 6]}") for i in range(60)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("needs dpkg-deb (Debian/Ubuntu)")
    cache = tmp_path_factory.mktemp("debs") / "cache"
    cache.mkdir()
    p = prose(6)
    html = "usr/share/doc/debian-handbook/html/"
    make_deb(cache, "debian-handbook", {
        f"{html}en-US/a.html": f"<html><nav>Prev Next</nav><h1>Chapter</h1><p>{p[0]}</p>"
                               f"<p>{p[1]}</p></html>".encode(),
        f"{html}en-US/stub.html": b"<p>Only a few words here.</p>",
        f"{html}en-US/genindex.html": f"<p>{p[2]}</p>".encode(),
        f"{html}fr-FR/a.html": f"<p>{p[3]}</p>".encode(),
    })
    make_deb(cache, "manpages", {
        "usr/share/man/man1/frob.1.gz": gzip.compress(MAN.encode()),
        "usr/share/man/man3/alias.3.gz": gzip.compress(b".so man1/frob.1\n"),
        "usr/share/man/fr/man1/frob.1.gz": gzip.compress(MAN.encode()),
    })
    pod = "usr/share/perl/5.36.0/pod/"
    make_deb(cache, "perl-doc", {
        f"{pod}perlfrob.pod": f"{POD}\n=head1 MORE\n\n{p[0]}\n\n{p[4]}\n".encode(),
        f"{pod}perl5360delta.pod": f"=head1 DELTA\n\n{p[5]}\n".encode(),
    })
    entries = dict_entries()
    data, index = b"", ["00-database-short\tA\tB"]
    for word, text in entries:
        index.append(f"{word}\t{b64(len(data))}\t{b64(len(text.encode()))}")
        data += text.encode()
    make_deb(cache, "dict-devil", {"usr/share/dictd/devil.index": "\n".join(index).encode(),
                                   "usr/share/dictd/devil.dict.dz": gzip.compress(data)})
    return cache


def test_html_source(cache):
    docs = read("debian-handbook", cache)
    # Only the English prose page: the stub is too short, the index and translations skipped.
    assert [d.id for d in docs] == ["debian-handbook:a.html"]
    p = prose(2)
    assert docs[0].text == f"Chapter\n\n{' '.join(p[0].split())}\n\n{' '.join(p[1].split())}"


def test_man_source(cache):
    docs = read("manpages", cache)
    assert [d.id for d in docs] == ["manpages:man1/frob.1"]  # .so alias and fr/ left out
    assert docs[0].text.startswith("FROB(1)\n\nNAME\n\nfrob - twiddle the bits of a file")


def test_pod_source(cache):
    docs = read("perl-doc", cache)
    assert [d.id for d in docs] == ["perl-doc:perlfrob.pod"]  # per-release deltas left out
    assert "\n\nMORE\n\n" in docs[0].text
    assert docs[0].text.endswith(" ".join(prose(5)[4].split()))


def test_dictd_source(cache):
    docs = read("dict-devil", cache)
    entries = dict_entries()
    assert len(docs) >= 2 and docs[0].id == "dict-devil:devil:word000"
    assert all(len(d.text) >= DICT_DOC_CHARS for d in docs[:-1])
    # Every entry once, in order, none of the database's own metadata.
    assert "\n\n".join(d.text for d in docs) == "\n\n".join(t for _, t in entries)


def test_build_from_debian_sources(cache, tmp_path):
    names = ["debian-handbook", "manpages", "perl-doc", "dict-devil"]
    out = build_dataset(tmp_path / "out", names, vocab_size=300, cache_dir=cache,
                        min_val_tokens=0, val_fraction=0.2, verbose=False)
    m = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in m["sources"]] == names
    assert [s["license"] for s in m["sources"]] == [DEBIAN_DOCS[n].license for n in names]
    # The POD repeats a paragraph of the handbook: its copy is removed, the first kept.
    assert m["sources"][2]["dedup"]["repeated_paragraphs"] == 1
    assert m["sources"][0]["dedup"]["chars_removed"] == 0


def test_mix_definition():
    mix = corpus.MIXES["docs-mix"]
    assert corpus.expand(["docs-mix"]) == list(mix)
    assert corpus.expand(["wikipedia", "docs-mix"])[:2] == ["wikipedia", "wikipedia"]
    assert len(set(mix)) == len(mix) and set(mix) <= set(corpus.SOURCES)
    assert mix[:3] == ("wikipedia", "linux-docs", "python-docs")
    for name in mix:
        src = corpus.SOURCES[name]
        assert src.license and src.license != "unknown" and src.description
    for spec in DEBIAN_DOCS.values():
        assert spec.prefix.endswith("/") and spec.markup in ("html", "man", "pod", "text",
                                                             "dictd")
    assert MIN_WORDS > 0


@pytest.mark.parametrize(("name", "path", "read"), [
    ("wireshark-doc", "wsug_html_chunked/ChapterIntroduction.html", True),
    ("wireshark-doc", "wsdg_html_chunked/ChSrcBuildFirstTime.html", True),
    ("wireshark-doc", "release-notes.html", False),
    ("ns3-doc", "manual/html/_sources/attributes.rst.txt", True),
    ("ns3-doc", "models/html/_sources/wifi-design.rst.txt", True),
    ("ns3-doc", "manual/html/attributes.html", False),
    ("pacemaker-doc", "Pacemaker_Explained/singlehtml/index.html", True),
    ("pacemaker-doc", "html/gl__openssl_8h.html", False),  # Doxygen of the C sources
    ("pacemaker-doc", "crm_fencing.html", False),
    ("libstdc++-doc", "user/a01234.html", True),
    ("libstdc++-doc", "user/a01234_source.html", False),  # a header's source listing
    ("libstdc++-doc", "user/functions_b.html", False),
    ("libstdc++-doc", "manual/using.html", True),
    ("derby-doc", "org/apache/derby/jdbc/EmbeddedDriver.html", True),
    ("derby-doc", "org/apache/derby/jdbc/class-use/EmbeddedDriver.html", False),
    ("derby-doc", "index-files/index-1.html", False),
    ("groovy-doc", "groovy/lang/package-tree.html", False),
    ("openjdk-17-doc", "allclasses-index.html", False),
    ("rust-web-doc", "std/vec/struct.Vec.html", True),
    ("rust-web-doc", "src/alloc/vec/mod.rs.html", False),
    ("db5.3-doc", "programmer_reference/intro.html", True),
    ("db5.3-doc", "java/com/sleepycat/db/Database.html", False),
    ("apache2-doc", "mod/core.html", True),
    ("python-pytest-doc", "how-to/fixtures.html", True),
    ("python-pytest-doc", "announce/release-7.0.0.html", False),
    ("python-pytest-doc", "genindex.html", False),
    ("dpdk-guides", "prog_guide/mbuf_lib.rst.txt", True),
    ("dpdk-guides", "rel_notes/release_22_11.rst.txt", False),
    ("python-tornado-doc", "guide/async.html", True),
    ("python-tornado-doc", "releases/v6.2.0.html", False),
    ("python-hypothesis-doc", "changes.html", False),
    ("python-lxml-doc", "apidoc/_modules/lxml/html.html", False),  # highlighted source code
    ("gnutls-doc", "api-reference/api-index-full.html", False),
])
def test_the_sources_read_the_pages_they_name(name, path, read):
    assert selects(DEBIAN_DOCS[name], path) is read


def test_mix_build_is_deterministic(tmp_path, monkeypatch):
    """A mix is expanded before anything is read; building it twice gives the same bytes."""
    dirs = []
    for i, chunk in enumerate((prose(6)[:3], prose(6)[3:])):
        d = tmp_path / f"src{i}"
        d.mkdir()
        for j, text in enumerate(chunk):
            (d / f"{j}.txt").write_text(text)
        dirs.append(str(d))
    monkeypatch.setitem(corpus.MIXES, "small-mix", tuple(dirs))
    kw = {"vocab_size": 300, "min_val_tokens": 0, "val_fraction": 0.3, "verbose": False}
    a = build_dataset(tmp_path / "a", ["small-mix"], **kw)
    b = build_dataset(tmp_path / "b", ",".join(dirs).split(","), **kw)
    for name in build_module.OUTPUT_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes()


@needs_dpkg
@pytest.mark.parametrize("name", ["dict-devil", "manpages", "debian-policy"])
def test_real_package_if_cached(name):
    """The real package, when a build has already downloaded it (nothing is downloaded here)."""
    cache = build_module.default_cache_dir()
    package = DEBIAN_DOCS[name].package
    if not sorted(cache.glob(f"{package}_*.deb")):
        pytest.skip(f"{package} is not in {cache} (fp4stack data build downloads it)")
    docs = read(name, cache)
    assert len(docs) >= 10
    assert all(len(d.text.split()) >= 20 for d in docs)
    text = "\n".join(d.text for d in docs)
    # Markup is gone (pages that document roff itself quote a few font escapes).
    assert len(re.findall(r"\\f[BIRP]|<p>|\x00", text)) <= len(text) / 100_000
