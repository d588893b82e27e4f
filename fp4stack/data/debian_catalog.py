"""The Debian documentation packages and dictionaries of the docs-mix corpus: for each named
source, the package, the folder and files it reads, their markup, the licence of its Debian
copyright file and what it is. Sizes per source after deduplication: docs/DATA.md. How a
package is read: debian_docs.py.

The table's order is the mix's, and deduplication keeps the first copy of a repeated page or
paragraph: Rust 1.85's pages that repeat Rust 1.63's are dropped from rust-web-doc, not from
rust-doc.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DebianDoc:
    package: str
    prefix: str  # folder inside the package, ending in "/"
    suffixes: tuple[str, ...]
    markup: str  # a key of _CONVERTERS, or "dictd"
    license: str
    description: str
    exclude: str = ""  # regular expression over the path below `prefix`


_SPHINX = r"(^|/)(_modules|_static|_images|_downloads)/"
# javadoc's generated lists: indexes, trees, class uses, the all-classes pages.
_JAVADOC = (r"index-files|-tree\.html$|/class-use/|package-use\.html$|(^|/)(allclasses|"
            "allpackages|constant-values|deprecated-list|overview-tree|serialized-form|help-doc)")
# Release notes and change logs, as Sphinx projects name them.
_NEWS = (r"|(^|/)(changelog|changes|history|whatsnew|whats_new|news|releases|release[-_]?notes)"
         r"[^/]*(/|\.html$)")
_LANG = "ca|cs|de|es|fr|hu|it|ja|nl|pt|zh|ko|ru"
_LANGS = rf"(^|/)({_LANG})(/|$)|\.({_LANG})\.html$"  # translations: English only

DEBIAN_DOCS: dict[str, DebianDoc] = {
    # Books and manuals, mostly prose.
    "debian-handbook": DebianDoc(
        "debian-handbook", "usr/share/doc/debian-handbook/html/en-US/", (".html",), "html",
        "GPL-2.0-or-later OR CC-BY-SA-3.0", "The Debian Administrator's Handbook (English)"),
    "debian-reference": DebianDoc(
        "debian-reference-en", "usr/share/debian-reference/", (".en.html",), "html",
        "GPL-2.0-or-later", "Debian Reference (English)"),
    "debian-policy": DebianDoc(
        "debian-policy", "usr/share/doc/debian-policy/policy.html/_sources/", (".txt",),
        "text", "GPL-2.0-or-later", "Debian Policy Manual (reST sources)"),
    "developers-reference": DebianDoc(
        "developers-reference", "usr/share/developers-reference/_sources/", (".txt",), "text",
        "GPL-2.0", "Debian Developer's Reference (reST sources)"),
    "maint-guide": DebianDoc(
        "maint-guide", "usr/share/doc/maint-guide/html/", (".en.html",), "html",
        "GPL-2.0-or-later", "Debian New Maintainers' Guide (English)"),
    "gnu-standards": DebianDoc(
        "gnu-standards", "usr/share/doc/gnu-standards/", (".html",), "html",
        "GFDL-1.3-or-later", "GNU Coding Standards and Information for Maintainers of GNU "
        "Software"),
    "perl-doc": DebianDoc(
        "perl-doc", "usr/share/perl/5.36.0/pod/", (".pod",), "pod", "GPL-1.0-or-later OR "
        "Artistic-1.0-Perl", "Perl 5.36 manual (POD)", exclude=r"perl5\d+delta|perlhist"),
    "rust-doc": DebianDoc(
        "rust-doc", "usr/share/doc/rust-doc/html/", (".html",), "html", "MIT OR Apache-2.0",
        "Rust 1.63 books (The Rust Programming Language, reference, nomicon, Rust by Example, "
        "unstable book) and standard library API documentation",
        exclude=r"^src/|/(all|sidebar-items|print)\.html$|/core_arch/"),
    "git-doc": DebianDoc(
        "git-doc", "usr/share/doc/git-doc/", (".txt",), "text", "GPL-2.0",
        "Git manual pages, user manual and technical documentation (AsciiDoc sources)",
        exclude=r"RelNotes|^howto-index"),
    "bash-doc": DebianDoc(
        "bash-doc", "usr/share/doc/bash/", (".html",), "html", "GPL-3.0-or-later",
        "Bash reference manual"),
    "postgresql-doc": DebianDoc(
        "postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html/", (".html",), "html",
        "PostgreSQL", "PostgreSQL 15 documentation", exclude=r"^release-|^bookindex"),
    "sqlite-doc": DebianDoc(
        "sqlite3-doc", "usr/share/doc/sqlite3/", (".html",), "html", "public-domain",
        "SQLite documentation", exclude=r"^releaselog/|^(changes|chronology|sitemap|"
        r"doclist|keyword_index|toc)\.html$"),
    "vim-doc": DebianDoc(
        "vim-doc", "usr/share/doc/vim/html/", (".html",), "html", "Vim", "Vim 9.0 help "
        "files", exclude=r"^(tags|version\d)"),
    "cmake-doc": DebianDoc(
        "cmake-doc", "usr/share/doc/cmake-data/html/_sources/", (".txt",), "text",
        "BSD-3-Clause", "CMake 3.25 documentation (reST sources)", exclude=r"^release/"),
    "python-django-doc": DebianDoc(
        "python-django-doc", "usr/share/doc/python-django-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Django 3.2 documentation", exclude=_SPHINX + r"|^releases/"),
    "python-scipy-doc": DebianDoc(
        "python-scipy-doc", "usr/share/doc/python-scipy-doc/html/", (".html",), "html",
        "BSD-3-Clause", "SciPy 1.10 documentation", exclude=_SPHINX + r"|^release/"),
    "python-sklearn-doc": DebianDoc(
        "python-sklearn-doc", "usr/share/doc/python-sklearn-doc/html/_sources/", (".txt",),
        "text", "BSD-3-Clause", "scikit-learn 1.2 documentation (reST sources)",
        exclude=r"^whats_new"),
    "python-pandas-doc": DebianDoc(
        "python-pandas-doc", "usr/share/doc/python-pandas-doc/html/", (".html",), "html",
        "BSD-3-Clause", "pandas 1.5 documentation", exclude=_SPHINX + r"|^whatsnew/"),
    "python-statsmodels-doc": DebianDoc(
        "python-statsmodels-doc", "usr/share/doc/python-statsmodels-doc/html/", (".html",),
        "html", "BSD-3-Clause", "statsmodels 0.13 documentation",
        exclude=_SPHINX + r"|^release/"),
    "python-sympy-doc": DebianDoc(
        "python-sympy-doc", "usr/share/doc/python-sympy-doc/html/", (".html",), "html",
        "BSD-3-Clause", "SymPy 1.11 documentation", exclude=_SPHINX),
    "python-astropy-doc": DebianDoc(
        "python-astropy-doc", "usr/share/doc/python-astropy-doc/html/_sources/", (".txt",),
        "text", "BSD-3-Clause", "Astropy 5.2 documentation (reST sources)",
        exclude=r"^changelog"),
    "twisted-doc": DebianDoc(
        "twisted-doc", "usr/share/doc/twisted-doc/html/", (".html",), "html", "MIT",
        "Twisted 22.4 documentation and API reference", exclude=_SPHINX + r"|^api/.*\.html\?"),
    "qtbase5-doc": DebianDoc(
        "qtbase5-doc-html", "usr/share/qt5/doc/", (".html",), "html",
        "GFDL-1.3-no-invariants-only", "Qt 5.15 base documentation",
        exclude=r"-(members|obsolete)\.html$"),
    "openjdk-17-doc": DebianDoc(
        "openjdk-17-doc", "usr/share/doc/openjdk-17-jre-headless/api/", (".html",), "html",
        "GPL-2.0 WITH Classpath-exception-2.0", "Java SE 17 API documentation",
        exclude=_JAVADOC),
    "cppreference": DebianDoc(
        "cppreference-doc-en-html", "usr/share/cppreference/doc/html/en/", (".html",), "html",
        "CC-BY-SA-3.0 OR GFDL-1.2-no-invariants", "cppreference.com C and C++ reference "
        "(2017)"),
    "erlang-doc": DebianDoc(
        "erlang-doc", "usr/share/doc/erlang-doc/", (".html",), "html", "Apache-2.0",
        "Erlang/OTP 25 documentation", exclude=r"(^|/)(wx-[^/]*|man_index|release_notes|"
        r"notes)(/|\.html$)"),
    "racket-doc": DebianDoc(
        "racket-doc", "usr/share/doc/racket/", (".html",), "html",
        "MIT OR Apache-2.0", "Racket 8.7 documentation (guide, reference, libraries)"),
    "ghc-doc": DebianDoc(
        "ghc-doc", "usr/share/doc/ghc-doc/html/", (".html",), "html", "BSD-3-Clause",
        "GHC 9.0 user's guide and Haskell library documentation",
        exclude=r"(^|/)src/|doc-index|mini_"),
    "lilypond-doc": DebianDoc(
        "lilypond-doc-html", "usr/share/doc/lilypond/html/", (".html",), "html",
        "GFDL-1.3-or-later", "LilyPond 2.24 manuals (English)", exclude=_LANGS),
    "gimp-help": DebianDoc(
        "gimp-help-en", "usr/share/gimp/2.0/help/en/", (".html",), "html",
        "GFDL-1.2-or-later", "GIMP 2.10 user manual (English)"),
    "ada-rm": DebianDoc(
        "ada-reference-manual-2020", "usr/share/doc/ada-reference-manual-2020/aarm2020.txt/",
        (".TXT",), "text", "ARM-License (copy and distribute verbatim)",
        "Annotated Ada 2022 Reference Manual (text)"),
    "sagemath-doc": DebianDoc(
        "sagemath-doc", "usr/share/doc/sagemath/html/en/", (".html",), "html",
        "GPL-2.0-or-later", "SageMath 9.5 documentation (English)", exclude=_SPHINX),
    "boost-doc": DebianDoc(
        "libboost1.81-doc", "usr/share/doc/libboost1.81-doc/doc/html/", (".html",), "html",
        "BSL-1.0", "Boost 1.81 library documentation"),
    "llvm-doc": DebianDoc(
        "llvm-19-doc", "usr/share/doc/llvm-19-doc/html/_sources/", (".txt",), "text",
        "Apache-2.0 WITH LLVM-exception", "LLVM 19 documentation (reST sources)",
        exclude=r"ReleaseNotes"),
    "clang-doc": DebianDoc(
        "clang-19-doc", "usr/share/doc/clang-19/html/_sources/", (".txt",), "text",
        "Apache-2.0 WITH LLVM-exception", "Clang 19 documentation (reST sources)",
        exclude=r"ReleaseNotes|AttributeReference|DiagnosticsReference"),
    "linux-docs-6.12": DebianDoc(
        "linux-doc-6.12", "usr/share/doc/linux-doc-6.12/Documentation/", (".rst.gz",
        ".txt.gz"), "text", "GPL-2.0", "Linux 6.12 kernel documentation (reST sources; mostly "
        "the same pages as linux-docs, which deduplication removes)"),
    "nodejs-doc": DebianDoc(
        "nodejs-doc", "usr/share/doc/nodejs/api/", (".md.gz", ".md"), "text", "MIT",
        "Node.js API documentation (Markdown)", exclude=r"^all\.|^index\."),
    "octave-doc": DebianDoc(
        "octave-doc", "usr/share/doc/octave/", (".html",), "html", "GPL-3.0-or-later",
        "GNU Octave manual"),
    "gnuplot-doc": DebianDoc(
        "gnuplot-doc", "usr/share/doc/gnuplot/htmldocs/", (".html",), "html", "gnuplot",
        "gnuplot manual"),
    "kicad-doc": DebianDoc(
        "kicad-doc-en", "usr/share/doc/kicad/help/en/", (".html",), "html",
        "GPL-3.0-or-later", "KiCad user manuals (English)"),
    "glib-doc": DebianDoc(
        "libglib2.0-doc", "usr/share/gtk-doc/html/", (".html",), "html", "LGPL-2.1-or-later",
        "GLib, GObject and GIO reference manuals", exclude=r"(^|/)(api-index|annotation-"
        r"glossary|ix\d+|index)[^/]*\.html$"),
    "gtk4-doc": DebianDoc(
        "libgtk-4-doc", "usr/share/doc/libgtk-4-doc/", (".html",), "html",
        "LGPL-2.1-or-later", "GTK 4 reference manuals"),
    "sphinx-doc": DebianDoc(
        "sphinx-doc", "usr/share/doc/sphinx-doc/html/", (".html",), "html", "BSD-2-Clause",
        "Sphinx documentation", exclude=_SPHINX + r"|^changes"),
    "python-sqlalchemy-doc": DebianDoc(
        "python-sqlalchemy-doc", "usr/share/doc/python-sqlalchemy-doc/html/", (".html",),
        "html", "MIT", "SQLAlchemy documentation", exclude=_SPHINX + r"|^changelog/"),
    "python-dask-doc": DebianDoc(
        "python-dask-doc", "usr/share/doc/python-dask-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Dask documentation", exclude=_SPHINX + r"|^changelog"),
    "python-xarray-doc": DebianDoc(
        "python-xarray-doc", "usr/share/doc/python-xarray-doc/html/", (".html",), "html",
        "Apache-2.0", "xarray documentation", exclude=_SPHINX + r"|^whats-new"),
    "python-celery-doc": DebianDoc(
        "python-celery-doc", "usr/share/doc/python-celery-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Celery documentation", exclude=_SPHINX + r"|^(history|changelog)"),
    "python-ase-doc": DebianDoc(
        "python-ase-doc", "usr/share/doc/python-ase-doc/html/", (".html",), "html",
        "LGPL-2.1-or-later", "Atomic Simulation Environment documentation",
        exclude=_SPHINX + r"|^releasenotes"),
    "scala-doc": DebianDoc(
        "scala-doc", "usr/share/doc/scala-2.11/api/", (".html",), "html", "BSD-3-Clause",
        "Scala 2.11 standard library API documentation",
        exclude=r"index/index-|(^|/)deprecated-list\.html$"),
    # More manuals and guides, a newer Rust, C++ and OpenSSL references and two javadoc trees:
    # what brings the deduplicated mix past 150M tokens.
    "libreoffice-help": DebianDoc(
        "libreoffice-help-en-us", "usr/share/libreoffice/help/en-US/text/", (".html",), "html",
        "MPL-2.0", "LibreOffice help pages (English)"),
    "apache2-doc": DebianDoc(
        "apache2-doc", "usr/share/doc/apache2-doc/manual/en/", (".html",), "html",
        "Apache-2.0", "Apache HTTP Server 2.4 documentation (English)"),
    "maxima-doc": DebianDoc(
        "maxima-doc", "usr/share/doc/maxima-doc/html/", (".html",), "html", "GPL-2.0",
        "Maxima computer algebra system manual"),
    "biopython-tutorial": DebianDoc(
        "python-biopython-doc", "usr/share/doc/python-biopython-doc/Doc/", (".html",), "html",
        "LicenseRef-Biopython OR BSD-3-Clause", "Biopython tutorial and cookbook"),
    "wireshark-doc": DebianDoc(
        "wireshark-doc", "usr/share/doc/wireshark/", (".html",), "html", "GPL-2.0-or-later",
        "Wireshark user's and developer's guides",
        exclude=r"^(?!ws[ud]g_html_chunked/)"),
    "ns3-doc": DebianDoc(
        "ns3-doc", "usr/share/doc/ns3/", (".rst.txt",), "text", "GPL-2.0",
        "ns-3 network simulator manual, model library and tutorial (reST sources)",
        exclude=r"^(?!(models|manual|tutorial)/html/_sources/)"),
    "zsh-doc": DebianDoc(
        "zsh-doc", "usr/share/doc/zsh-common/html/", (".html",), "html", "Zsh (MIT-like)",
        "Zsh manual"),
    "python-pytest-doc": DebianDoc(
        "python-pytest-doc", "usr/share/doc/python-pytest-doc/html/", (".html",), "html",
        "MIT", "pytest documentation", exclude=_SPHINX + r"|^(changelog|announce/)"),
    "python-pil-doc": DebianDoc(
        "python-pil-doc", "usr/share/doc/python-pil-doc/html/", (".html",), "html", "HPND",
        "Pillow documentation", exclude=_SPHINX + r"|^releasenotes/"),
    "python-mpmath-doc": DebianDoc(
        "python-mpmath-doc", "usr/share/doc/python-mpmath-doc/html/", (".html",), "html",
        "BSD-3-Clause", "mpmath documentation", exclude=_SPHINX),
    "bind9-doc": DebianDoc(
        "bind9-doc", "usr/share/doc/bind9-doc/arm/", (".html",), "html", "MPL-2.0",
        "BIND 9 Administrator Reference Manual", exclude=_SPHINX + r"|^notes"),
    "exim4-doc": DebianDoc(
        "exim4-doc-html", "usr/share/doc/exim4-doc-html/spec_html/", (".html",), "html",
        "GPL-2.0-or-later", "Exim 4 specification"),
    "r-manuals": DebianDoc(
        "r-doc-html", "usr/share/R/doc/manual/", (".html",), "html", "GPL-2.0",
        "R manuals (introduction, data, administration, extensions, internals, FAQ)"),
    "python-flask-doc": DebianDoc(
        "python-flask-doc", "usr/share/doc/python-flask-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Flask documentation", exclude=_SPHINX + r"|^changes"),
    "python-werkzeug-doc": DebianDoc(
        "python-werkzeug-doc", "usr/share/doc/python-werkzeug-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Werkzeug documentation", exclude=_SPHINX + r"|^changes"),
    "python-jinja2-doc": DebianDoc(
        "python-jinja2-doc", "usr/share/doc/python-jinja2-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Jinja documentation", exclude=_SPHINX + r"|^changes"),
    "python-setuptools-doc": DebianDoc(
        "python-setuptools-doc", "usr/share/doc/python-setuptools-doc/html/", (".html",),
        "html", "MIT", "setuptools documentation", exclude=_SPHINX + r"|^history"),
    "dpdk-guides": DebianDoc(
        "dpdk-doc", "usr/share/doc/dpdk/guides/_sources/", (".rst.txt",), "text",
        "BSD-3-Clause", "DPDK guides (reST sources)", exclude=r"^rel_notes/"),
    "pacemaker-doc": DebianDoc(
        "pacemaker-doc", "usr/share/doc/pacemaker/", (".html",), "html", "CC-BY-SA-4.0",
        "Pacemaker books (Clusters from Scratch, Administration, Explained, Remote, "
        "Development)", exclude=r"^(?![A-Za-z_]+/singlehtml/)"),
    "db5.3-doc": DebianDoc(
        "db5.3-doc", "usr/share/doc/db5.3-doc/", (".html",), "html", "Sleepycat",
        "Berkeley DB 5.3 guides and C/C++ API reference",
        exclude=r"^(java|csharp)/|^api_reference/(STL|TCL)/"),
    "clisp-doc": DebianDoc(
        "clisp-doc", "usr/share/doc/clisp/doc/", (".html",), "html", "GPL-2.0-or-later",
        "CLISP implementation notes and manual"),
    "rust-web-doc": DebianDoc(
        "rust-web-doc", "usr/share/doc/rust-web-doc/html/", (".html",), "html",
        "MIT OR Apache-2.0", "Rust 1.85 books and standard library API documentation (much of "
        "it the same pages as rust-doc's 1.63, which deduplication removes)",
        exclude=r"^src/|/(all|sidebar-items|print)\.html$|/core_arch/"),
    "libstdc++-doc": DebianDoc(
        "libstdc++-12-doc", "usr/share/doc/gcc-12-base/libstdc++/", (".html",), "html",
        "GPL-3.0-or-later WITH GCC-exception-3.1 AND GFDL-1.3-no-invariants-or-later",
        "GNU C++ library manual and API documentation (Doxygen)",
        exclude=r"_source\.html$|(^|/)(functions|namespacemembers|globals|hierarchy|annotated|"
        r"files|namespaces|modules|pages|classes|dir_|inherits)[^/]*\.html$"),
    "openssl-manpages": DebianDoc(
        "libssl-doc", "usr/share/man/", (".gz",), "man", "Apache-2.0",
        "OpenSSL 3.0 library manual pages"),
    "gnutls-doc": DebianDoc(
        "gnutls-doc", "usr/share/doc/gnutls-doc/", (".html",), "html",
        "GFDL-1.3-or-later AND LGPL-2.1-or-later", "GnuTLS manual and API reference",
        exclude=r"api-index"),
    "haproxy-doc": DebianDoc(
        "haproxy-doc", "usr/share/doc/haproxy/", (".html",), "html", "GPL-2.0-or-later",
        "HAProxy configuration and management manuals, Lua API", exclude=_SPHINX),
    "postfix-doc": DebianDoc(
        "postfix-doc", "usr/share/doc/postfix/html/", (".html",), "html",
        "IPL-1.0 OR EPL-2.0", "Postfix documentation"),
    "varnish-doc": DebianDoc(
        "varnish-doc", "usr/share/doc/varnish/html/", (".html",), "html", "BSD-2-Clause",
        "Varnish Cache documentation", exclude=_SPHINX + _NEWS),
    "python-tornado-doc": DebianDoc(
        "python-tornado-doc", "usr/share/doc/python-tornado-doc/html/", (".html",), "html",
        "Apache-2.0", "Tornado documentation", exclude=_SPHINX + _NEWS),
    "python-lxml-doc": DebianDoc(
        "python-lxml-doc", "usr/share/doc/python-lxml/html/", (".html",), "html",
        "BSD-3-Clause", "lxml documentation", exclude=_SPHINX + _NEWS),
    "python-scrapy-doc": DebianDoc(
        "python-scrapy-doc", "usr/share/doc/python-scrapy-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Scrapy documentation", exclude=_SPHINX + _NEWS),
    "python-ipython-doc": DebianDoc(
        "python-ipython-doc", "usr/share/doc/python-ipython-doc/html/", (".html",), "html",
        "BSD-3-Clause", "IPython documentation", exclude=_SPHINX + _NEWS),
    "python-kombu-doc": DebianDoc(
        "python-kombu-doc", "usr/share/doc/python-kombu-doc/html/", (".html",), "html",
        "BSD-3-Clause", "Kombu documentation", exclude=_SPHINX + _NEWS),
    "python-hypothesis-doc": DebianDoc(
        "python-hypothesis-doc", "usr/share/doc/python-hypothesis-doc/html/", (".html",),
        "html", "MPL-2.0", "Hypothesis documentation", exclude=_SPHINX + _NEWS),
    "python-cryptography-doc": DebianDoc(
        "python-cryptography-doc", "usr/share/doc/python-cryptography-doc/html/", (".html",),
        "html", "Apache-2.0 OR BSD-3-Clause", "cryptography documentation",
        exclude=_SPHINX + _NEWS),
    "python-pymongo-doc": DebianDoc(
        "python-pymongo-doc", "usr/share/doc/python-pymongo-doc/html/", (".html",), "html",
        "Apache-2.0", "PyMongo documentation", exclude=_SPHINX + _NEWS),
    "python-pygments-doc": DebianDoc(
        "python-pygments-doc", "usr/share/doc/python-pygments-doc/html/", (".html",), "html",
        "BSD-2-Clause", "Pygments documentation", exclude=_SPHINX + _NEWS),
    "mypy-doc": DebianDoc(
        "mypy-doc", "usr/share/doc/mypy/html/", (".html",), "html", "MIT",
        "mypy documentation", exclude=_SPHINX + _NEWS),
    "derby-doc": DebianDoc(
        "derby-doc", "usr/share/doc/derby-doc/javadoc/", (".html",), "html", "Apache-2.0",
        "Apache Derby API documentation", exclude=_JAVADOC),
    "groovy-doc": DebianDoc(
        "groovy-doc", "usr/share/doc/groovy/api/", (".html",), "html", "Apache-2.0",
        "Apache Groovy API documentation", exclude=_JAVADOC),
    # Manual pages.
    "manpages": DebianDoc(
        "manpages", "usr/share/man/", (".gz",), "man", "GPL-2.0-or-later (various, see the "
        "package's copyright file)", "Linux man-pages: sections 1, 4, 5, 7",
        exclude=r"^(?!man\d/)"),
    "manpages-dev": DebianDoc(
        "manpages-dev", "usr/share/man/", (".gz",), "man", "GPL-2.0-or-later (various, see the "
        "package's copyright file)", "Linux man-pages: system calls and C library (2, 3)",
        exclude=r"^(?!man\d/)"),
    "freebsd-manpages": DebianDoc(
        "freebsd-manpages", "usr/share/man/", (".gz",), "man", "BSD-2-Clause-FreeBSD AND "
        "BSD-4-Clause", "FreeBSD 12.2 kernel and device manual pages"),
    # Dictionaries (dictd databases).
    "dict-gcide": DebianDoc(
        "dict-gcide", "usr/share/dictd/", (), "dictd", "GPL-3.0-or-later",
        "GNU Collaborative International Dictionary of English (Webster's 1913 and additions)"),
    "dict-wn": DebianDoc(
        "dict-wn", "usr/share/dictd/", (), "dictd", "WordNet-3.0", "WordNet 3.0 glosses"),
    "dict-foldoc": DebianDoc(
        "dict-foldoc", "usr/share/dictd/", (), "dictd", "GFDL-1.1-or-later",
        "Free On-line Dictionary of Computing"),
    "dict-jargon": DebianDoc(
        "dict-jargon", "usr/share/dictd/", (), "dictd", "public-domain",
        "The Jargon File 4.4.7"),
    "dict-vera": DebianDoc(
        "dict-vera", "usr/share/dictd/", (), "dictd", "GFDL-1.1-or-later",
        "V.E.R.A.: Virtual Entity of Relevant Acronyms"),
    "dict-devil": DebianDoc(
        "dict-devil", "usr/share/dictd/", (), "dictd", "public-domain",
        "The Devil's Dictionary by Ambrose Bierce"),
}
