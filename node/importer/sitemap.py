"""Sitemaps (``<urlset><url><loc>…</loc><changefreq>…</changefreq>``),
streamed through expat; a document with a DTD is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from xml.parsers import expat

from node.core.errors import ValidationError
from node.importer.base import Fill, ImportFileError, Item

# Bytes fed to the XML parser at a time.
XML_CHUNK = 1 << 16

CHANGEFREQ_S = {
    "always": 3600,
    "hourly": 3600,
    "daily": 86400,
    "weekly": 604800,
    "monthly": 2592000,
    "yearly": 31536000,
    "never": 31536000,
}
SITEMAP_DEFAULT_ROUTE = "default"
SITEMAP_NS = "http://www.sitemaps.org/schemas/sitemap/0.9"


def _split_name(name: str) -> tuple[str, str]:
    """expat's ``uri}local`` (namespace_separator "}") into (uri, local)."""
    uri, sep, local = name.rpartition("}")
    return (uri, local) if sep else ("", name)


class _SitemapReader:
    """Streams ``<url>`` entries out of a urlset with expat (the parser under
    ElementTree, used directly for its line numbers). A DTD is refused where
    it starts, before any entity could be declared or expanded."""

    def __init__(self, path: Path, fill: Fill) -> None:
        self.path = path
        self.fill = fill
        self.out: list[Item] = []
        self.depth = 0
        self.ns = ""
        self.in_url = False
        self.url_line = 0
        self.values: dict[str, str] = {}
        self.field: str | None = None
        self.text: list[str] = []
        p = expat.ParserCreate(namespace_separator="}")
        p.buffer_text = True
        p.StartElementHandler = self.start
        p.EndElementHandler = self.end
        p.CharacterDataHandler = self.data
        p.StartDoctypeDeclHandler = self.refuse_dtd
        p.EntityDeclHandler = self.refuse_dtd
        self.parser = p

    def refuse_dtd(self, *args: Any) -> None:
        raise ImportFileError(
            f"{self.path}:{self.parser.CurrentLineNumber}: the document has a DTD "
            "(<!DOCTYPE or <!ENTITY); sitemaps with DTDs are refused"
        )

    def start(self, name: str, attrs: Any) -> None:
        ns, local = _split_name(name)
        self.depth += 1
        line = self.parser.CurrentLineNumber
        if self.depth == 1:
            if local == "sitemapindex":
                raise ImportFileError(
                    f"{self.path}:{line}: this is a sitemap index; import each sitemap it lists"
                )
            if local != "urlset":
                raise ImportFileError(
                    f"{self.path}:{line}: the root element is <{local}>, not <urlset>"
                )
            self.ns = ns
        elif self.depth == 2 and local == "url" and ns == self.ns:
            self.in_url, self.url_line, self.values = True, line, {}
        elif self.depth == 3 and self.in_url and ns == self.ns and local in ("loc", "changefreq"):
            self.field, self.text = local, []

    def data(self, text: str) -> None:
        if self.field is not None:
            self.text.append(text)

    def end(self, name: str) -> None:
        if self.depth == 3 and self.field is not None:
            self.values.setdefault(self.field, "".join(self.text).strip())
            self.field = None
        elif self.depth == 2 and self.in_url:
            self.in_url = False
            self.out.append((self.url_line, self.entry(self.values)))
        self.depth -= 1

    def entry(self, values: dict[str, str]) -> Any:
        if "loc" not in values:
            return ValidationError("missing_field", "<url> has no <loc>", "loc")
        obj: dict[str, Any] = {
            "key": values["loc"],
            "route": self.fill.route or SITEMAP_DEFAULT_ROUTE,
            "sitemap": True,
            # No changefreq: --cadence, else the route's default (null).
            "cadence_s": self.fill.cadence_s,
        }
        if self.fill.job is not None:
            obj["job"] = self.fill.job
        freq = values.get("changefreq")
        if freq is not None:
            seconds = CHANGEFREQ_S.get(freq.lower())
            if seconds is None:
                return ValidationError(
                    "invalid_cadence",
                    f"unknown changefreq {freq!r}; allowed: " + ", ".join(CHANGEFREQ_S),
                    "changefreq",
                )
            obj["cadence_s"] = seconds
        return obj

    def feed(self, chunk: bytes, final: bool = False) -> list[Item]:
        try:
            self.parser.Parse(chunk, final)
        except expat.ExpatError as exc:
            raise ImportFileError(
                f"{self.path}:{exc.lineno}: not well-formed XML: {expat.ErrorString(exc.code)}"
            ) from None
        out, self.out = self.out, []
        return out


def read_sitemap(f: IO[bytes], path: Path, fill: Fill) -> Iterator[Item]:
    reader = _SitemapReader(path, fill)
    tail = b""
    first = True
    while True:
        chunk = f.read(XML_CHUNK)
        if first:
            first = False
            if chunk[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in chunk[:4]:
                raise ImportFileError(f"{path}: sitemaps must be UTF-8 (sitemaps.org)")
        # Belt and braces: refuse the markup outright, even where expat would
        # be given no chance to see it (the handlers above refuse it too).
        window = (tail + chunk).lower()
        if b"<!doctype" in window or b"<!entity" in window:
            raise ImportFileError(
                f"{path}: the document has a DTD (<!DOCTYPE or <!ENTITY); "
                "sitemaps with DTDs are refused"
            )
        tail = window[-16:]
        yield from reader.feed(chunk, final=not chunk)
        if not chunk:
            return
