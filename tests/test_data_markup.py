"""Markup stripping for the documentation corpora: HTML, man pages, POD, dictd databases.

Man pages and POD are checked against the reference formatters (groff, pod2text) where they are
installed: the words of our text must be the words they render, in the same order.
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fp4stack.data.markup import dictd_entries, html_to_text, pod_to_text, roff_to_text


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]{2,}", text)


# ------------------------------------------------------------------------------------- HTML

PAGE = """<!DOCTYPE html><html><head><title>Ignored title</title>
<script>var x = "<p>not text</p>";</script><style>p { color: red }</style></head>
<body><nav><a href="/">Home</a> <a href="/next">Next page</a></nav>
<div class="sphinxsidebar"><div><h3>Table of contents</h3></div><p>sidebar words</p></div>
<div role="navigation">Breadcrumbs here</div>
<h1>Queues&nbsp;and&#32;stacks</h1>
<p>A <em>queue</em> is first-in,
   first-out; a <a href="s.html">stack</a> is last-in, first-out &amp; both are lists.</p>
<pre>def push(x):
    items.append(x)   # indented code keeps its lines
</pre>
<ul><li>one</li><li>two<br>lines</li></ul>
<table><tr><td>cell a</td><td>cell b</td></tr></table>
<img src="x.png" alt="an image"><hr/>
<footer>Copyright 2024</footer></body></html>"""


def test_html_keeps_prose_and_drops_chrome():
    text = html_to_text(PAGE)
    paragraphs = text.split("\n\n")
    assert paragraphs[0] == "Queues and stacks"
    assert paragraphs[1] == ("A queue is first-in, first-out; a stack is last-in, first-out & "
                             "both are lists.")
    assert paragraphs[2] == "def push(x):\n    items.append(x)   # indented code keeps its lines"
    assert paragraphs[3:] == ["one", "two\nlines", "cell a cell b"]
    for gone in ("Ignored title", "not text", "color", "Home", "Next page", "Table of contents",
                 "sidebar words", "Breadcrumbs", "Copyright", "an image"):
        assert gone not in text


def test_html_nested_skipped_elements_and_unclosed_tags():
    html = ('<div class="toc"><div>inner <div>deeper</div></div> still toc</div>'
            '<p>kept one<p>kept two<div>kept three')
    assert html_to_text(html) == "kept one\n\nkept two\n\nkept three"
    assert html_to_text("") == ""
    assert html_to_text("<p>  \n </p>") == ""


# --------------------------------------------------------------------------------- man pages

MAN = r""".\" A comment that must not appear
.TH FROB 1 "2024-01-01" "frob 1.0" "User Commands"
.SH NAME
frob \- twiddle the bits of a file
.SH SYNOPSIS
.B frob
[\fB\-v\fR]
.RI [ file ...]
.SH DESCRIPTION
.B frob
reads each
.I file
and rewrites it with its bits twiddled\(em quickly.
Long lines are joined
into one paragraph.
.PP
A second paragraph, with \fIitalic\fP and \fBbold\fP words and a \e backslash.
.TP
.BR \-v ", " \-\-verbose
Print each file name\[em]as it is done.
.SS Examples
.nf
frob a.txt
    frob \-v b.txt
.fi
.SH "SEE ALSO"
.BR od (1),
.BR xxd (1)
"""


def test_roff_structure():
    text = roff_to_text(MAN)
    paragraphs = text.split("\n\n")
    assert paragraphs[0] == "FROB(1)"
    assert "NAME" in paragraphs and "SEE ALSO" in paragraphs and "Examples" in paragraphs
    assert "frob - twiddle the bits of a file" in paragraphs
    assert ("frob reads each file and rewrites it with its bits twiddled\u2014 quickly. Long "
            "lines are joined into one paragraph.") in paragraphs
    assert ("A second paragraph, with italic and bold words and a \\ backslash.") in paragraphs
    assert "frob a.txt\n    frob -v b.txt" in paragraphs  # no-fill block keeps its lines
    assert "-v, --verbose\nPrint each file name\u2014as it is done." in paragraphs
    assert "od(1), xxd(1)" in paragraphs
    assert "comment" not in text and "\\f" not in text and "2024-01-01" not in text


def test_roff_so_page_is_empty():
    assert roff_to_text(".so man3/other.3\n") == ""


def _groff_words(page: str) -> list[str] | None:
    if shutil.which("groff") is None:
        return None
    out = subprocess.run(["groff", "-man", "-Tutf8", "-P-cbou", "-rHY=0", "-rLL=200n"],
                         input=page, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    lines = out.stdout.strip().split("\n")
    # Drop the running header and footer lines groff adds.
    return words("\n".join(lines[1:-1]))


@pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff")
def test_roff_words_match_groff_fixture():
    ours, theirs = words(roff_to_text(MAN)), _groff_words(MAN)
    assert theirs is not None
    # Our text opens with the title line groff puts in the header instead.
    assert ours[1:] == theirs


def _system_man_pages(n: int) -> list[Path]:
    root = Path("/usr/share/man")
    pages = sorted(p for sec in ("man1", "man5", "man7", "man8") for p in (root / sec).glob(
        "*.gz")) if root.is_dir() else []
    return pages[:: max(1, len(pages) // n)][:n]


@pytest.mark.skipif(shutil.which("groff") is None or not _system_man_pages(1),
                    reason="needs groff and installed man pages")
def test_roff_words_close_to_groff_on_installed_pages():
    """On real pages (man and mdoc macros, tables, conditionals) the text is close to groff's:
    most of groff's words, in order, and few others (tbl tables and macro-built strings may
    differ)."""
    import difflib

    checked = 0
    for path in _system_man_pages(25):
        page = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
        if page.lstrip().startswith(".so") or "\n.TS" in page:
            continue
        theirs = _groff_words(page)
        if not theirs or len(theirs) < 50:
            continue
        ours = words(roff_to_text(page))
        matcher = difflib.SequenceMatcher(None, ours, theirs, autojunk=False)
        matched = sum(b.size for b in matcher.get_matching_blocks())
        assert matched >= 0.9 * len(theirs), (path, matched / len(theirs))
        assert matched >= 0.85 * len(ours), (path, matched / len(ours))
        checked += 1
    assert checked >= 5


# ---------------------------------------------------------------------------------------- POD

POD = """=head1 NAME

perlfrob - how to E<lt>frobE<gt> in Perl

=head1 DESCRIPTION

Use B<frob> with I<care>: see L<perlfunc/open> and L<the guide|perlguide>.
The C<< $x->frob >> method
returns S<a list>.X<frob>

    my $x = Frob->new;   # verbatim
    $x->frob;

=over 4

=item * First item

=item * Second C<item>

=back

=begin html

<p>only for HTML</p>

=end html

=cut
"""


def test_pod_structure():
    text = pod_to_text(POD)
    paragraphs = text.split("\n\n")
    assert paragraphs[:3] == ["NAME", "perlfrob - how to <frob> in Perl", "DESCRIPTION"]
    assert paragraphs[3] == ("Use frob with care: see open in perlfunc and the guide. The $x->frob "
                             "method returns a list.")
    assert paragraphs[4] == "    my $x = Frob->new;   # verbatim\n    $x->frob;"
    assert paragraphs[5:] == ["First item", "Second item"]
    assert "only for HTML" not in text


@pytest.mark.skipif(shutil.which("pod2text") is None, reason="needs pod2text (perl)")
def test_pod_words_match_pod2text():
    out = subprocess.run(["pod2text"], input=POD, capture_output=True, text=True, check=True)
    assert words(pod_to_text(POD)) == words(out.stdout)


# -------------------------------------------------------------------------------------- dictd

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64(n: int) -> str:
    digits = ""
    while True:
        digits = B64[n % 64] + digits
        n //= 64
        if n == 0:
            return digits


def test_dictd_entries():
    entries = [("apple", "apple\n  n. A fruit."), ("bee", "bee\n  n. An insect; " + "x" * 5000),
               ("cat", "cat\n  n. A pet.")]
    data = b""
    index = ["00-database-info\tA\tB"]  # metadata: skipped
    for word, text in entries:
        raw = text.encode()
        index.append(f"{word}\t{b64(len(data))}\t{b64(len(raw))}")
        data += raw
    index.append(f"honeybee\t{index[2].split(chr(9), 1)[1]}")  # a second headword, same entry
    index.append("broken line")
    got = dictd_entries("\n".join(sorted(index)) + "\n", data)
    assert got == entries
