"""Plain text from documentation markup: HTML, man pages (roff), Perl POD, dictd databases.

Each converter is a pure function from the markup to text whose paragraphs are separated by one
blank line. Prose is kept with its words and punctuation; navigation, scripts, styles and
formatting requests are dropped; preformatted blocks (code, examples) keep their line breaks.
They are deliberately small: the corpus needs readable text, not a faithful rendering.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

_PARA = "\x00P"  # paragraph break, resolved by _paragraphs
_LINE = "\x00L"  # line break inside a paragraph
_PRE = "\x01"  # marks a paragraph whose lines keep their indentation

_SPACE = re.compile(r"\s+")


def _paragraphs(stream: str) -> str:
    """Resolve break markers: paragraphs joined by one blank line, lines stripped (preformatted
    paragraphs keep their left indentation), empty lines and paragraphs dropped."""
    out = []
    for para in stream.split(_PARA):
        pre = para.startswith(_PRE)
        lines = para.replace(_PRE, "").replace(_LINE, "\n").split("\n")
        lines = [ln.rstrip() if pre else ln.strip() for ln in lines]
        text = "\n".join(ln for ln in lines if ln.strip())
        if text:
            out.append(text)
    return "\n\n".join(out)


# -------------------------------------------------------------------------------------- HTML

# Elements whose content is never prose.
_SKIP = {"script", "style", "head", "nav", "header", "footer", "noscript", "svg", "math",
         "button", "form", "select", "textarea", "template", "iframe", "object", "canvas"}
# Class or id words of navigation and chrome in the generators Debian's documentation uses
# (Sphinx, rustdoc, javadoc, DocBook, Doxygen, Scribble, MediaWiki dumps, ...).
_SKIP_CLASSES = {"sphinxsidebar", "related", "navigation", "navbar", "sidebar", "toc",
                 "breadcrumb", "breadcrumbs", "headerlink", "navheader",
                 "navfooter", "sub-nav", "top-nav", "bottom-nav", "tocset", "tocview",
                 "mw-jump", "printfooter", "catlinks", "mw-editsection", "t-navbar", "srclink",
                 "rightside", "anchor", "copyright", "legalnotice", "skip-nav", "hidden"}
_BLOCK = {"p", "div", "section", "article", "main", "aside", "blockquote", "h1", "h2", "h3",
          "h4", "h5", "h6", "li", "ul", "ol", "dl", "dt", "dd", "table", "tr", "caption",
          "figure", "figcaption", "hr", "title", "details", "summary", "center"}
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr", "param"}


class _HTMLText(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_tag: str | None = None  # the element being skipped, and its open count
        self.skip_depth = 0
        self.pre = 0

    def _skipped(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        if tag in _SKIP:
            return True
        if any(v == "navigation" for k, v in attrs if k == "role"):
            return True
        words = set()
        for key, value in attrs:
            if key in ("class", "id") and value:
                words.update(value.lower().split())
        return bool(words & _SKIP_CLASSES)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth += 1
            return
        if tag not in _VOID and self._skipped(tag, attrs):
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self.pre += 1
            self.parts.append(_PARA + _PRE)
        elif tag == "br":
            self.parts.append("\n" if self.pre else _LINE)
        elif tag in _BLOCK:
            self.parts.append(_PARA)
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in _VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self.parts.append(_PARA)
        elif tag in _BLOCK:
            self.parts.append(_PARA)

    def handle_data(self, data: str) -> None:
        if self.skip_tag is not None:
            return
        self.parts.append(data if self.pre else _SPACE.sub(" ", data))


def html_to_text(html: str) -> str:
    """The visible prose of an HTML page: block elements become paragraphs, <pre> keeps its
    lines, and head, scripts, styles and navigation (by element, role or class) are dropped."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    return _paragraphs("".join(parser.parts))


# ---------------------------------------------------------------------------------- man pages

_ROFF_CHARS = {
    "em": "\u2014", "en": "\u2013", "hy": "-", "aq": "'", "dq": '"', "lq": "\u201c",
    "rq": "\u201d", "oq": "\u2018", "cq": "\u2019", "bu": "\u2022", "co": "\u00a9",
    "rg": "\u00ae", "tm": "\u2122", "mu": "\u00d7", "di": "\u00f7", "+-": "\u00b1",
    "->": "\u2192", "<-": "\u2190", "<=": "\u2264", ">=": "\u2265", "!=": "\u2260",
    "de": "\u00b0", "ti": "~", "ha": "^", "rs": "\\", "sl": "/", "ba": "|", "or": "|",
    "at": "@", "sh": "#", "Do": "$", "ga": "`", "aa": "\u00b4", "ul": "_", "pl": "+",
    "mi": "-", "eq": "=", "lB": "[", "rB": "]", "lC": "{", "rC": "}", "la": "\u27e8",
    "ra": "\u27e9", "dg": "\u2020", "sc": "\u00a7", "ps": "\u00b6", "ct": "\u00a2",
}
_ROFF_ESCAPE = re.compile(
    r"\\(?:"
    r"\((?P<two>..)"                      # \(xx: a named character
    r"|\[(?P<long>[^\]]*)\]"              # \[name]
    r"|\*(?:\(..|\[[^\]]*\]|.)"           # \*x, \*(xx, \*[name]: strings, dropped
    r"|f(?:\(..|\[[^\]]*\]|.)"            # \fB, \f(CW, \f[B]: font changes, dropped
    r"|s[-+]?(?:\d|\(\d\d|\[\d+\])"       # \s+1: size changes, dropped
    r"|[nk](?:\(..|\[[^\]]*\]|.)"         # registers and marks, dropped
    r"|[hvwlLDoxbXNYZzgR]'[^']*'"         # escapes with a quoted argument, dropped
    r"|(?P<one>.)"                        # one-character escapes
    r")"
)
_ROFF_ONE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "\u00b4",
             "`": "`", ".": ".", "t": "\t"}
_FONT_MACROS = {"B", "I", "SM", "SB"}  # words joined with spaces
_ALT_MACROS = {"BI", "BR", "IB", "IR", "RB", "RI"}  # alternating fonts: words joined as one


def _roff_inline(text: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group("two") is not None:
            return _ROFF_CHARS.get(m.group("two"), "")
        if m.group("long") is not None:
            name = m.group("long")
            return _ROFF_CHARS.get(name, chr(int(name[1:], 16)) if re.fullmatch(
                r"u[0-9A-Fa-f]{4,6}", name) else "")
        one = m.group("one")
        return _ROFF_ONE.get(one, "") if one is not None else ""

    return _ROFF_ESCAPE.sub(sub, text)


def _roff_args(line: str) -> list[str]:
    """A request's arguments: words, or double-quoted strings ("" is a literal quote)."""
    args, i = [], 0
    while i < len(line):
        if line[i].isspace():
            i += 1
        elif line[i] == '"':
            j, buf = i + 1, []
            while j < len(line):
                if line.startswith('""', j):
                    buf.append('"')
                    j += 2
                elif line[j] == '"':
                    break
                else:
                    buf.append(line[j])
                    j += 1
            args.append("".join(buf))
            i = j + 1
        else:
            j = i
            while j < len(line) and not line[j].isspace():
                j += 2 if line[j] == "\\" else 1  # "\ " is a space inside the word
            args.append(line[i:j])
            i = j
    return args


def roff_to_text(page: str) -> str:
    """The text of a man page (man or mdoc macros): section headings as paragraphs, filled text
    joined, no-fill blocks (.nf, .EX) kept line by line, escapes and font changes resolved, all
    other requests dropped. A page that only sources another (.so) has no text."""
    parts: list[str] = []
    fill = True
    tag = False  # the next text line is a .TP tag: a line of its own

    def text(s: str) -> None:
        nonlocal tag
        parts.append(s + ("\n" if not fill else _LINE if tag else " "))
        tag = False

    for raw in page.split("\n"):
        line = raw.split('\\"', 1)[0] if '\\"' in raw else raw  # comments
        if not line.startswith((".", "'")):
            if not line.strip():
                parts.append(_PARA if fill else "\n")
            else:
                text(_roff_inline(line))
            continue
        name, _, rest = line[1:].lstrip().partition(" ")
        rest = rest.strip()
        if name in ("SH", "SS", "Sh", "Ss"):
            parts += [_PARA, _roff_inline(" ".join(_roff_args(rest))), _PARA]
        elif name == "TH" or name == "Dt":
            args = _roff_args(rest)
            if args:
                parts += [_PARA, f"{args[0]}({args[1]})" if len(args) > 1 else args[0], _PARA]
        elif name in ("PP", "LP", "P", "Pp", "sp", "HP", "Lp"):
            parts.append(_PARA)
        elif name in ("TP", "TQ"):
            parts.append(_PARA if name == "TP" else _LINE)
            tag = True
        elif name == "br":
            parts.append(_LINE)
        elif name in ("IP", "It"):
            parts.append(_PARA)
            if rest:
                parts.append(_roff_inline(" ".join(_roff_args(rest)[:1] if name == "IP"
                                                   else _roff_args(rest))) + " ")
        elif name in ("nf", "EX", "Bd"):
            fill = False
            parts.append(_PARA + _PRE)
        elif name in ("fi", "EE", "Ed"):
            fill = True
            parts.append(_PARA)
        elif name in _FONT_MACROS or name in ("Nm", "Ar", "Fl", "Cm", "Em", "Sy", "Va", "Fn",
                                              "Xr", "Pa", "Nd", "Dv", "Er", "Ev", "Li", "Ql"):
            if name == "Fl":
                text("-" + " ".join(_roff_args(rest)))
            elif rest:
                text(_roff_inline(" ".join(_roff_args(rest))))
        elif name in _ALT_MACROS:
            text(_roff_inline("".join(_roff_args(rest))))
        elif name == "so":
            return ""
        # Every other request (.de, .if, .ds, .nr, .RS, .UR, .in, ...) is formatting only.
    return _paragraphs("".join(parts).replace(" \n", "\n"))


# ---------------------------------------------------------------------------------------- POD

_POD_DOUBLE = re.compile(r"([A-Z])<{2,}\s+(.*?)\s+>{2,}", re.S)
_POD_SINGLE = re.compile(r"([A-Z])<([^<>]*)>")
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&",
                 "apos": "'", "nbsp": " "}


def _pod_code(code: str, body: str) -> str:
    if code in ("X", "Z"):
        return ""
    if code == "E":
        if body.isdigit():
            return chr(int(body))
        if body.lower().startswith("0x"):
            return chr(int(body, 16))
        return _POD_ENTITIES.get(body, "")
    if code == "L":
        shown, bar, target = body.partition("|")
        if bar:
            return shown
        page, _, section = body.replace('"', "").partition("/")
        return f"{section} in {page}" if section and page else section or page
    return body  # B, I, C, F, S: the text itself


def _pod_inline(text: str) -> str:
    text = _POD_DOUBLE.sub(lambda m: _pod_code(m.group(1), m.group(2)), text)
    while True:  # innermost first, so nested codes resolve
        new = _POD_SINGLE.sub(lambda m: _pod_code(m.group(1), m.group(2)), text)
        if new == text:
            return new
        text = new


def pod_to_text(pod: str) -> str:
    """The text of a Perl POD document: headings and items as paragraphs, verbatim (indented)
    paragraphs kept, formatting codes resolved, =begin/=for blocks and commands dropped."""
    out = []
    skipping = False
    for para in re.split(r"\n\s*\n", pod.replace("\r\n", "\n")):
        if not para.strip():
            continue
        if para.startswith("="):
            command, _, rest = para[1:].partition(" ")
            command = command.split("\n", 1)[0]
            if command == "begin":
                skipping = True
            elif command == "end":
                skipping = False
            elif not skipping and command.startswith(("head", "item")):
                rest = rest.strip()
                if rest and rest not in ("*", "-") and not rest.isdigit():
                    out.append(_pod_inline(rest.lstrip("*- ").strip()))
            continue
        if skipping:
            continue
        if para[0] in " \t":
            out.append(_PRE + para)  # verbatim: no formatting codes
        else:
            out.append(_pod_inline(" ".join(para.split())))
    return _paragraphs(_PARA.join(out))


# ----------------------------------------------------------------------------------- dictd

_B64 = {c: i for i, c in enumerate(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64_number(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


def dictd_entries(index: str, data: bytes) -> list[tuple[str, str]]:
    """(headword, definition) of a dictd database, in the order of the data file. `index` is
    the .index file (headword TAB offset TAB length, numbers in dictd's base64), `data` the
    uncompressed .dict. Entries reached by several headwords appear once; the database's own
    metadata entries (00-database-*, 00databaseinfo, ...) are left out, and the braces that
    mark cross-references ({word}) are removed."""
    seen: dict[tuple[int, int], str] = {}
    for line in index.split("\n"):
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith(("00-", "00database")):
            continue
        try:
            key = (_b64_number(fields[1]), _b64_number(fields[2]))
        except KeyError:
            continue  # a malformed line: not an entry
        seen.setdefault(key, fields[0])
    entries = []
    for (offset, length), word in sorted(seen.items()):
        text = data[offset : offset + length].decode("utf-8", errors="replace").strip()
        text = text.replace("{", "").replace("}", "")  # {word}: a cross-reference
        if text:
            entries.append((word, text))
    return entries


__all__ = ["dictd_entries", "html_to_text", "pod_to_text", "roff_to_text"]
