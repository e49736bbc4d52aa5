"""Every table the harness prints or writes: plain text for terminals and CI logs, Markdown for reports.

Both go through `tabulate`; cells are shown as str() shows them (no number parsing, no reformatting),
so a figure a caller formatted ("12.3", "1e-05", "0012") prints as it was given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tabulate import tabulate

_ALIGN = {"left": "left", "right": "right", "center": "center", "<": "left", ">": "right", "^": "center"}


def _cells(header: Sequence, rows: Iterable[Sequence]) -> tuple[list[str], list[list[str]]]:
    return [str(h) for h in header], [[str(x) for x in r] for r in rows]


def _colalign(align: Sequence[str] | None, n: int) -> tuple[str, ...]:
    if align is None:
        return ("left",) * n
    if len(align) != n:
        raise ValueError(f"align has {len(align)} entries for {n} columns")
    return tuple(_ALIGN[a] for a in align)


def table(header: Sequence, rows: Iterable[Sequence], align: Sequence[str] | None = None) -> str:
    """Aligned columns two spaces apart, the header underlined with dashes, no trailing blanks:

        case     outcome  wall
        -------  -------  ----
        tp2-pp1  pass     3s

    align: one of left / right / center (or < > ^) per column; default every column left."""
    head, body = _cells(header, rows)
    # The underline is a row of its own: tabulate's "simple" format pads a column to its header + 2
    widths = [max(len(part) for cell in col for part in cell.split("\n")) for col in zip(head, *body)]
    text = tabulate([head, ["-" * w for w in widths], *body], tablefmt="plain",
                    colalign=_colalign(align, len(head)), disable_numparse=True)
    return "\n".join(line.rstrip() for line in text.split("\n"))


def md_escape(text: str) -> str:
    """A cell's text made safe inside a Markdown table row: pipes escaped, newlines flattened."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence, rows: Iterable[Sequence]) -> str:
    """A GitHub-flavoured Markdown table, cells unpadded (`| tp2-pp1 | pass | 3s |`, as renderers and greps
    of report.md read it); pipes and newlines inside cells are escaped."""
    head, body = _cells(header, rows)
    return tabulate([[md_escape(x) for x in r] for r in body], [md_escape(h) for h in head], tablefmt="github",
                    stralign=None, numalign=None, disable_numparse=True)
