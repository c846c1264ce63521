"""``python -m node import``: formats, all-or-nothing, --skip-invalid, DTD
refusal, exit codes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from node import importer
from node.config import Config, RouteConfig
from node.core.errors import StoreError, TooManyClasses
from node.importer import ImportFailed, ImportFileError, bulk, import_file, main
from node.importer import sitemap as sitemap_reader
from node.store import open_store
from node.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_700_000_000.0
NS = "http://www.sitemaps.org/schemas/sitemap/0.9"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("QUEUE_NODE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(path: Path, *rows: Any) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def sitemap(path: Path, body: str, ns: str = f' xmlns="{NS}"') -> Path:
    return write(path, f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset{ns}>\n{body}</urlset>\n')


# -- JSON lines -----------------------------------------------------------------


def test_json_lines(tmp_path: Path, store: MemoryStore) -> None:
    path = jsonl(
        tmp_path / "rows.jsonl",
        {"key": "a", "route": "r", "cadence_s": 600, "payload": {"x": 1}},
        {"key": "b"},
        {"key": "c", "route": "own", "job": "mine"},
    )
    report = import_file(path, store, route="fill", cadence_s=3600, job="j", now=NOW)
    assert report.summary() == {"imported": 3, "invalid": 0}
    assert report.format == "jsonl"
    a, b, c = store.get("a"), store.get("b"), store.get("c")
    assert (a.route, a.cadence_s, a.payload, a.job, a.due_at) == ("r", 600, {"x": 1}, "j", NOW)
    assert (b.route, b.cadence_s, b.job) == ("fill", 3600, "j")
    assert (c.route, c.cadence_s, c.job) == ("own", 3600, "mine")
    assert {ch.origin for ch in store.changes(0, 10)} == {"node"}


def test_json_lines_bad_lines_named_and_nothing_imported(
    tmp_path: Path, store: MemoryStore
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b'{"key": "a", "route": "r"}\n'  # 1 ok
        b"\n"  # 2 blank: skipped
        b'{"key": "b", "route": "r", "cadence_s": 5}\n'  # 3
        b"not json\n"  # 4
        b'["a list"]\n'  # 5
        b'{"key": "c", "route": "r", "due_at": NaN}\n'  # 6
        b'{"key": "\xff", "route": "r"}\n'  # 7 not UTF-8
        + b'{"key": "d", "route": "r", "payload": '
        + b"[" * 5000
        + b"]" * 5000
        + b"}\n"  # 8
        + b'{"key": "e", "route": "r", "color": 1}\n'  # 9
        b'{"key": "f", "route": "r"}\n'  # 10 ok
    )
    seen: list[importer.LineError] = []
    report = import_file(path, store, now=NOW, on_invalid=seen.append)
    assert report.summary() == {"imported": 0, "invalid": 7}
    assert report.valid == 2
    assert [e.line for e in seen] == [3, 4, 5, 6, 7, 8, 9]
    assert [e.code for e in seen] == [
        "invalid_cadence",
        "invalid_json",
        "invalid_row",
        "invalid_json",
        "invalid_json",
        "invalid_json",
        "unknown_field",
    ]
    assert str(seen[0]).startswith(f"{path}:3: ")
    assert store.count() == 0 and store.last_seq() == 0


def test_skip_invalid_imports_the_valid_lines(tmp_path: Path, store: MemoryStore) -> None:
    path = jsonl(
        tmp_path / "rows.jsonl",
        {"key": "a", "route": "r"},
        {"key": "b"},
        {"key": "c", "route": "r"},
    )
    seen: list[importer.LineError] = []
    report = import_file(path, store, skip_invalid=True, now=NOW, on_invalid=seen.append)
    assert report.summary() == {"imported": 2, "invalid": 1}
    assert [(e.line, e.code, e.field) for e in seen] == [(2, "missing_field", "route")]
    assert store.count() == 2


# -- CSV ------------------------------------------------------------------------


def test_csv_types(tmp_path: Path, store: MemoryStore) -> None:
    path = write(
        tmp_path / "rows.csv",
        "\ufeffkey,route,cadence_s,sitemap,due_at,payload,job\n"
        'a,r,1h,true,12.5,"{""x"": [1, 2]}",j\n'
        "b,r,600,0,,,\n"
        "c,r,,yes,,null,\n"
        'd,r,null,FALSE,100,"[1,\n2]",\n'
        "\n"
        "e,,7d,no,,,\n",
    )
    report = import_file(path, store, route="fill", now=NOW)
    assert report.summary() == {"imported": 5, "invalid": 0}
    a, b, c, d, e = (store.get(k) for k in "abcde")
    assert (a.cadence_s, a.sitemap, a.due_at, a.payload, a.job) == (
        3600,
        True,
        12.5,
        {"x": [1, 2]},
        "j",
    )
    assert (b.cadence_s, b.sitemap, b.due_at, b.payload, b.job) == (
        600,
        False,
        NOW,
        None,
        "default",
    )
    assert (c.cadence_s, c.sitemap) == (None, True)
    assert (d.cadence_s, d.due_at, d.payload) == (None, 100.0, [1, 2])
    assert (e.route, e.cadence_s) == ("fill", 604800)


def test_csv_bad_cells_are_named(tmp_path: Path, store: MemoryStore) -> None:
    path = write(
        tmp_path / "rows.csv",
        "key,route,cadence_s,sitemap,due_at,payload\n"
        "a,r,1h,true,,\n"  # 2 ok
        "b,r,soon,,,\n"  # 3
        "c,r,,maybe,,\n"  # 4
        "d,r,,,yesterday,\n"  # 5
        "e,r,,,,{not json}\n"  # 6
        "f,r,30s,,,\n"  # 7
        "g,r\n"  # 8
        "h,r,,,,,extra\n",  # 9
    )
    seen: list[importer.LineError] = []
    report = import_file(path, store, now=NOW, on_invalid=seen.append)
    assert report.imported == 0
    assert [(e.line, e.code) for e in seen] == [
        (3, "invalid_cadence"),
        (4, "invalid_sitemap"),
        (5, "invalid_due_at"),
        (6, "invalid_payload"),
        (7, "invalid_cadence"),
        (8, "invalid_row"),
        (9, "invalid_row"),
    ]
    assert store.count() == 0


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("key,route,colour", "unknown column 'colour'"),
        ("key,route,key", "named twice"),
        ("route,cadence_s", "no key column"),
    ],
)
def test_csv_bad_header_refuses_the_file(
    tmp_path: Path, store: MemoryStore, header: str, message: str
) -> None:
    path = write(tmp_path / "rows.csv", f"{header}\na,b,c\n")
    with pytest.raises(ImportFileError, match=message) as info:
        import_file(path, store, now=NOW)
    assert str(info.value).startswith(f"{path}:1: ")
    assert store.count() == 0


def test_csv_not_utf8_refuses_the_file(tmp_path: Path, store: MemoryStore) -> None:
    path = tmp_path / "rows.csv"
    path.write_bytes(b"key,route\na,r\nb\xff,r\n")
    with pytest.raises(ImportFileError, match="UTF-8"):
        import_file(path, store, now=NOW)
    assert store.count() == 0


# -- sitemaps -----------------------------------------------------------------------


def test_sitemap(tmp_path: Path, store: MemoryStore) -> None:
    freqs = {
        "always": 3600,
        "hourly": 3600,
        "daily": 86400,
        "weekly": 604800,
        "monthly": 2592000,
        "yearly": 31536000,
        "never": 31536000,
    }
    body = "".join(
        f"  <url>\n    <loc> https://x.test/{f} </loc>\n    <changefreq>{f.upper() if i else f}"
        "</changefreq>\n    <lastmod>2024-01-01</lastmod>\n  </url>\n"
        for i, f in enumerate(freqs)
    )
    body += "  <url><loc>https://x.test/plain</loc><priority>0.5</priority></url>\n"
    path = sitemap(tmp_path / "sitemap.xml", body)
    report = import_file(path, store, now=NOW)
    assert report.summary() == {"imported": 8, "invalid": 0}
    assert report.format == "sitemap"
    for f, seconds in freqs.items():
        row = store.get(f"https://x.test/{f}")
        assert (row.route, row.cadence_s, row.sitemap, row.due_at) == (
            "default",
            seconds,
            True,
            NOW,
        )
    plain = store.get("https://x.test/plain")
    assert (plain.cadence_s, plain.sitemap) == (None, True)


def test_sitemap_fills_and_namespaces(tmp_path: Path, store: MemoryStore) -> None:
    body = (
        '  <url xmlns:image="http://www.google.com/schemas/sitemap-image/1.1">\n'
        "    <image:image><image:loc>https://x.test/pic.png</image:loc></image:image>\n"
        "    <loc>https://x.test/a</loc>\n"
        "  </url>\n"
    )
    path = sitemap(tmp_path / "sitemap.xml", body)
    report = import_file(path, store, route="pages", cadence_s=7200, job="seo", now=NOW)
    assert report.imported == 1
    row = store.get("https://x.test/a")
    assert (row.route, row.cadence_s, row.job, row.sitemap) == ("pages", 7200, "seo", True)
    # No namespace at all is a sitemap too.
    path = sitemap(tmp_path / "bare.xml", "<url><loc>https://x.test/b</loc></url>", ns="")
    assert import_file(path, store, now=NOW).imported == 1


def test_sitemap_bad_entries_named_by_line(tmp_path: Path, store: MemoryStore) -> None:
    body = (
        "<url><loc>https://x.test/ok</loc></url>\n"  # line 3
        "<url><changefreq>daily</changefreq></url>\n"  # 4
        "<url><loc>https://x.test/c</loc><changefreq>sometimes</changefreq></url>\n"  # 5
        "<url><loc></loc></url>\n"  # 6
        f"<url><loc>{'k' * 1100}</loc></url>\n"  # 7
    )
    path = sitemap(tmp_path / "sitemap.xml", body)
    seen: list[importer.LineError] = []
    report = import_file(path, store, now=NOW, on_invalid=seen.append)
    assert report.imported == 0
    assert [(e.line, e.code) for e in seen] == [
        (4, "missing_field"),
        (5, "invalid_cadence"),
        (6, "invalid_key"),
        (7, "invalid_key"),
    ]
    assert store.count() == 0


@pytest.mark.parametrize(
    "document",
    [
        '<?xml version="1.0"?>\n<!DOCTYPE urlset [<!ENTITY x "boom">]>\n'
        f'<urlset xmlns="{NS}"><url><loc>&x;</loc></url></urlset>',
        # billion laughs
        '<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
        ' <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">\n]>\n'
        f'<urlset xmlns="{NS}"><url><loc>&lol2;</loc></url></urlset>',
        # an external entity
        '<?xml version="1.0"?>\n<!DOCTYPE urlset SYSTEM "file:///etc/passwd">\n'
        f'<urlset xmlns="{NS}"><url><loc>a</loc></url></urlset>',
        f'<urlset xmlns="{NS}"><url><loc>a</loc></url></urlset>\n<!-- <!ENTITY -->',
    ],
)
def test_sitemap_with_a_dtd_is_refused(tmp_path: Path, store: MemoryStore, document: str) -> None:
    path = write(tmp_path / "sitemap.xml", document)
    with pytest.raises(ImportFileError, match="DTD"):
        import_file(path, store, now=NOW)
    assert store.count() == 0


def test_the_parser_refuses_a_dtd_on_its_own(tmp_path: Path) -> None:
    """The byte scan is belt and braces; expat's handlers refuse too."""
    reader = sitemap_reader._SitemapReader(tmp_path / "x.xml", importer.Fill())
    with pytest.raises(ImportFileError, match=r"x\.xml:2: the document has a DTD"):
        reader.feed(b'<?xml version="1.0"?>\n<!DOCTYPE urlset []>\n<urlset/>', final=True)


def test_dtd_split_across_chunks_is_refused(
    tmp_path: Path, store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sitemap_reader, "XML_CHUNK", 7)
    path = write(tmp_path / "sitemap.xml", '<?xml version="1.0"?>\n<!DOCTYPE urlset>\n<urlset/>')
    with pytest.raises(ImportFileError, match="DTD"):
        import_file(path, store, now=NOW)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (f'<urlset xmlns="{NS}">\n<url><loc>a</loc>\n</urlset>'.encode(), r":3: not well-formed"),
        (
            f'<sitemapindex xmlns="{NS}"><sitemap><loc>a</loc></sitemap></sitemapindex>'.encode(),
            "sitemap index",
        ),
        (b"<html><body/></html>", "not <urlset>"),
        ("<urlset><url><loc>a</loc></url></urlset>".encode("utf-16"), "UTF-8"),
    ],
)
def test_malformed_sitemaps_refuse_the_file(
    tmp_path: Path, store: MemoryStore, data: bytes, message: str
) -> None:
    path = tmp_path / "sitemap.xml"
    path.write_bytes(data)
    with pytest.raises(ImportFileError, match=message):
        import_file(path, store, now=NOW)
    assert store.count() == 0


# -- detection, compression, batches, classes ------------------------------------


def test_format_by_content_and_gzip(tmp_path: Path, store: MemoryStore) -> None:
    j = jsonl(tmp_path / "rows", {"key": "j", "route": "r"})
    c = write(tmp_path / "table", "key,route\nc,r\n")
    s = sitemap(tmp_path / "urls", "<url><loc>s</loc></url>")
    g = tmp_path / "sitemap.xml.gz"
    g.write_bytes(gzip.compress(s.read_bytes().replace(b"<loc>s<", b"<loc>g<")))
    z = tmp_path / "mystery"
    z.write_bytes(gzip.compress(b'{"key": "z", "route": "r"}\n'))
    assert [importer.detect_format(p) for p in (j, c, s, g, z)] == [
        "jsonl",
        "csv",
        "sitemap",
        "sitemap",
        "jsonl",
    ]
    for p in (j, c, s, g, z):
        assert import_file(p, store, now=NOW).imported == 1
    assert store.count() == 5


class RecordingStore(MemoryStore):
    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.fail_after = fail_after

    def upsert(self, rows: Any, *, now: float, origin: str = "node") -> int:
        if self.fail_after is not None and len(self.batches) >= self.fail_after:
            raise StoreError("disk full")
        self.batches.append(len(rows))
        return super().upsert(rows, now=now, origin=origin)


def test_writes_in_batches_with_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "BATCH_ROWS", 3)
    monkeypatch.setattr(bulk, "PROGRESS_EVERY", 3)
    path = jsonl(tmp_path / "rows.jsonl", *({"key": f"k{i}", "route": "r"} for i in range(7)))
    store = RecordingStore()
    said: list[str] = []
    report = import_file(path, store, now=NOW, on_progress=said.append)
    assert report.imported == 7
    assert store.batches == [3, 3, 1]
    assert any("6 rows checked" in m for m in said)
    assert any("6 of 7 rows imported" in m for m in said)


def test_store_failure_part_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "BATCH_ROWS", 2)
    path = jsonl(tmp_path / "rows.jsonl", *({"key": f"k{i}", "route": "r"} for i in range(5)))
    store = RecordingStore(fail_after=1)
    with pytest.raises(ImportFailed, match="after 2 rows") as info:
        import_file(path, store, now=NOW)
    assert info.value.report.imported == 2
    assert store.count() == 2


def test_too_many_classes_imports_nothing(tmp_path: Path, store: MemoryStore) -> None:
    config = Config(name="t", workers=1, max_classes=2, routes={"r": RouteConfig(cadence_s=600)})
    path = jsonl(
        tmp_path / "rows.jsonl",
        {"key": "a", "route": "r"},
        {"key": "b", "route": "r", "cadence_s": 600},
        {"key": "c", "route": "r", "sitemap": True},
    )
    with pytest.raises(TooManyClasses):
        import_file(path, store, config=config, now=NOW)
    assert store.count() == 0
    config3 = Config(name="t", workers=1, max_classes=3, routes={"r": RouteConfig(cadence_s=600)})
    assert import_file(path, store, config=config3, now=NOW).imported == 3
    # The running keeper's classes count too.
    known = {("r", 600, "route", False), ("r", 600, "row", False), ("x", 60, "row", False)}
    path2 = jsonl(tmp_path / "more.jsonl", {"key": "d", "route": "r", "cadence_s": 120})
    with pytest.raises(TooManyClasses):
        import_file(path2, store, config=config3, known_classes=known, now=NOW)
    assert store.get("d") is None


# -- the command line ---------------------------------------------------------------


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_main_imports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = jsonl(tmp_path / "rows.jsonl", {"key": "a"}, {"key": "b", "route": "own"})
    url = f"sqlite:///{tmp_path}/s.db"
    code, out, err = run_main(
        capsys,
        str(path),
        "--store",
        url,
        "--route",
        "r",
        "--cadence",
        "1h",
        "--name",
        "no-such-node-here",
    )
    assert code == 0, err
    assert json.loads(out) == {"imported": 2, "invalid": 0}
    with open_store(url) as store:
        assert store.get("a").cadence_s == 3600
        assert store.get("b").route == "own"


def test_main_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "rows.csv", "key,route\na,r\n")
    code, out, err = run_main(capsys, str(path), "--data-dir", str(tmp_path / "data"))
    assert code == 0, err
    with open_store(f"sqlite:///{tmp_path}/data/schedule.db") as store:
        assert store.count() == 1


def test_main_invalid_lines_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = jsonl(
        tmp_path / "rows.jsonl",
        {"key": "a", "route": "r"},
        {"key": "b"},
        {"key": "c", "route": "r", "cadence_s": 1},
    )
    url = f"sqlite:///{tmp_path}/s.db"
    code, out, err = run_main(capsys, str(path), "--store", url)
    assert code == 2
    assert json.loads(out) == {"imported": 0, "invalid": 2}
    lines = err.splitlines()
    assert lines[0].startswith(f"{path}:2: ") and "[missing_field]" in lines[0]
    assert lines[1].startswith(f"{path}:3: ") and "[invalid_cadence]" in lines[1]
    assert "nothing imported" in lines[2]
    with open_store(url) as store:
        assert store.count() == 0 and store.last_seq() == 0

    code, out, err = run_main(capsys, str(path), "--store", url, "--skip-invalid")
    assert code == 0
    assert json.loads(out) == {"imported": 1, "invalid": 2}
    assert f"{path}:2: " in err and f"{path}:3: " in err and "skipped 2" in err
    with open_store(url) as store:
        assert store.count() == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "FILE"),
        (["{file}", "--bogus"], "--bogus"),
        (["{file}", "--cadence", "5s"], "--cadence"),
        (["{file}", "--cadence", "soon"], "--cadence"),
        (["{file}", "--route", ""], "route"),
        (["{file}", "--job", "bad job"], "job"),
        (["{file}", "--store", "mysql://db/x"], "unknown store URL"),
        (["{file}", "--store", "sqlite:///x.db", "--data-dir", "d"], "not allowed with"),
        (["{file}", "--format", "yaml"], "format"),
        (["{dir}/missing.jsonl"], "no such file"),
        (["{dtd}"], "DTD"),
        (["{classes}", "--config", "{config}"], "max_classes"),
    ],
)
def test_main_bad_arguments_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    file = jsonl(tmp_path / "rows.jsonl", {"key": "a", "route": "r"})
    dtd = write(tmp_path / "d.xml", "<!DOCTYPE urlset []><urlset/>")
    classes = jsonl(tmp_path / "c.jsonl", {"key": "a", "route": "x"}, {"key": "b", "route": "y"})
    config = write(tmp_path / "node.toml", "max_classes = 1\n")
    names = {"file": file, "dir": tmp_path, "dtd": dtd, "classes": classes, "config": config}
    argv = [a.format(**names) for a in args]
    if "--store" not in argv and "--data-dir" not in argv:
        argv += ["--store", f"sqlite:///{tmp_path}/s.db"]
    code, out, err = run_main(capsys, *argv)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err
    assert "Traceback" not in err


def test_main_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    assert "--skip-invalid" in out


def test_main_wakes_a_running_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], node_name: str
) -> None:
    from shm.wake import Wake

    wake = Wake.create(node_name)
    try:
        path = jsonl(tmp_path / "rows.jsonl", {"key": "a", "route": "r"})
        code, _, err = run_main(
            capsys, str(path), "--store", f"sqlite:///{tmp_path}/s.db", "--name", node_name
        )
        assert code == 0, err
        assert wake.drain() == 1
    finally:
        wake.close()
        Wake.unlink(node_name)


def test_subprocess_exit_codes(tmp_path: Path) -> None:
    good = jsonl(tmp_path / "good.jsonl", {"key": "a", "route": "r"})
    bad = jsonl(tmp_path / "bad.jsonl", {"key": "a", "route": "r"}, {"key": "b"})
    url = f"sqlite:///{tmp_path}/s.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUE_NODE_")}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=20
        )

    ok = run("-m", "node.importer", str(good), "--store", url)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"imported": 1, "invalid": 0}
    refused = run("-m", "node", "import", str(bad), "--store", url)
    assert refused.returncode == 2
    assert f"{bad}:2: " in refused.stderr
    assert "Traceback" not in refused.stderr
    usage = run("-m", "node.importer", str(good), "--cadence", "fortnightly")
    assert usage.returncode == 2
    assert len(usage.stderr.strip().splitlines()) == 1
