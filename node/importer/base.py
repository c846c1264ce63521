"""What the importer's readers and its writer share: the row a reader
yields, what the command line fills in, the errors and the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from node.core.errors import NodeError

# Bad lines kept in the report (all of them are passed to ``on_invalid``).
KEPT_ERRORS = 100


class ImportFileError(NodeError):
    """The file as a whole cannot be read: unreadable, malformed XML, a DTD,
    a bad CSV header. The message starts with ``file:line:`` where known."""


class ImportFailed(NodeError):
    """The store failed part-way; ``report.imported`` rows were written."""

    def __init__(self, message: str, report: ImportReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True, slots=True)
class LineError:
    path: str
    line: int
    code: str
    message: str
    field: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message} [{self.code}]"


@dataclass
class ImportReport:
    path: str
    format: str
    valid: int = 0  # lines that make a valid row
    imported: int = 0  # rows written
    invalid: int = 0  # bad lines
    errors: list[LineError] = field(default_factory=list)  # the first KEPT_ERRORS

    def summary(self) -> dict[str, int]:
        return {"imported": self.imported, "invalid": self.invalid}


@dataclass(frozen=True, slots=True)
class Fill:
    """What the command line fills into rows that leave a field out."""

    route: str | None = None
    cadence_s: int | None = None
    job: str | None = None

    def apply(self, obj: Any) -> Any:
        if isinstance(obj, dict):
            for name in ("route", "cadence_s", "job"):
                value = getattr(self, name)
                if value is not None and name not in obj:
                    obj[name] = value
        return obj


Item = tuple[int, Any]  # (line, a row object or a ValidationError)


def strict_constant(name: str) -> Any:
    """``parse_constant`` for ``json.loads``: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not JSON")
