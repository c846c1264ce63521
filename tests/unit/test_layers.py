"""The layout's promises a user relies on: the exceptions keep their
import path (``node.errors``) now that they live in the core."""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import node.core.errors as core_errors
import node.errors as errors


def test_node_errors_names_every_exception_of_the_core_as_the_same_class() -> None:
    defined = {
        name
        for name, obj in vars(core_errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, Exception)
        and obj.__module__ == core_errors.__name__
    }
    assert defined == set(errors.__all__)
    for name in defined:
        assert getattr(errors, name) is getattr(core_errors, name)


def test_node_config_names_the_cores_configuration_as_the_same_objects() -> None:
    import node.config
    import node.core.config

    assert set(node.config.__all__) == set(node.core.config.__all__)
    for name in node.config.__all__:
        assert getattr(node.config, name) is getattr(node.core.config, name)


def test_every_host_wide_name_comes_from_the_core() -> None:
    """node/core/names.py computes them; the modules that use them name the
    same functions (the old spellings are the same objects)."""
    from keeper import ask
    from node import names
    from node.core import names as core_names
    from shm import segment

    assert not hasattr(segment, "segment_name")  # one name, one meaning
    assert segment.owner_name is core_names.owner_name
    assert names.ledger_address is core_names.ledger_address
    assert core_names.shm_segment_name("n1", "ready") == "/queue-node.n1.ready"
    assert core_names.wake_name("n1") == "/queue-node.n1.wake"
    assert core_names.ledger_address("n1") == "\0queue-node.n1.ledger"
    assert core_names.ask_queue_name("n1") == ask.ask_queue_name("n1") == "/queue-node.n1.ask"
    assert ask.ask_queue_name is core_names.ask_queue_name
    assert ask.reply_queue_prefix is core_names.reply_queue_prefix


def test_the_keeper_and_the_workers_see_one_class_identity() -> None:
    """One definition (node/core/classes.py): the class a worker checks a
    write against is the class the keeper files the row in."""
    from keeper.classes import ClassTable
    from node.config import Config, RouteConfig
    from workers.classes import class_id

    config = Config(routes={"pages": RouteConfig(cadence_s=3600, sitemap_boost=1.0)})
    table = ClassTable(config)
    for route, cadence_s, sitemap in [("pages", None, True), ("pages", 3600, True),
                                      ("pages", 60, False), ("other", None, False)]:  # fmt: skip
        info = table.info(table.class_of(route, cadence_s, sitemap))
        assert (info.route, info.cadence_s, info.source, info.sitemap) == class_id(
            config, route, cadence_s, sitemap
        )
    # a row's own cadence equal to the route's is still another class
    assert table.class_of("pages", None, True) != table.class_of("pages", 3600, True)


def test_the_keepers_test_hook_answers_only_with_test_hooks_on() -> None:
    """``corrupt`` lives in keeper/test_hooks.py, reached only when the node
    runs with QUEUE_NODE_TEST_HOOKS=1; without it the question is unknown
    and the hook's module is never imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from keeper.process import Keeper\n"
        "k = Keeper.__new__(Keeper)\n"
        "k.test_hooks = False\n"
        "answer = Keeper.answer(k, {'op': 'corrupt', 'key': 'k', 'mode': 'drop'}, 0.0)\n"
        "print(answer.get('error', ''), 'keeper.test_hooks' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.stdout.strip() == "unknown op 'corrupt' False", done.stderr


ROOT = Path(__file__).resolve().parents[2]
# A path of the project's, as docs and comments name them (node/core/rows.py,
# shm/leases/, docs/api.md).
_NAMED_PATH = re.compile(
    r"(?<![\w./<>-])((?:node|shm|keeper|workers|tests|bench|scripts|docs|deploy|examples)"
    r"/[\w./-]*\.(?:py|c|h|md|pyi|toml))\b"
)


def test_the_docs_and_the_code_name_only_files_that_exist() -> None:
    """After a file moves, a doc or a comment that still sends the reader to
    its old place is a dead end; CHANGELOG.md, which is history, is exempt."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    missing = []
    for name in tracked:
        if name == "CHANGELOG.md" or not name.endswith((".py", ".c", ".h", ".md", ".pyi", ".toml")):
            continue
        text = (ROOT / name).read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for match in _NAMED_PATH.finditer(line):
                if not (ROOT / match.group(1)).exists():
                    missing.append(f"{name}:{number} names {match.group(1)}")
    assert not missing, "\n".join(missing)


def test_no_module_is_over_650_lines_without_its_reason_at_the_top() -> None:
    """The layout's rule: a module over ~650 lines says why in its first line
    (``# Over 650 lines: ...``), or it is split."""
    long = []
    for package in ("node", "shm", "keeper", "workers"):
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix not in (".py", ".c", ".h"):
                continue
            lines = path.read_text().splitlines()
            if len(lines) > 650 and not (lines and "Over 650 lines:" in lines[0]):
                long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not long, "\n".join(long)
