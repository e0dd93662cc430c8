"""Replacing one generated block of benchmarks/RESULTS.md, between its begin/end markers."""

from __future__ import annotations

import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"


def write_block(name: str, text: str, path: pathlib.Path = RESULTS) -> bool:
    """Put text between `<!-- name:begin -->` and `<!-- name:end -->`; False (and a message on
    stderr) when the file lacks those markers, so nothing else in it is ever overwritten."""
    doc = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in doc or end not in doc:
        print(f"{path.name} has no {name} markers; not written", file=sys.stderr)
        return False
    path.write_text(doc[: doc.index(begin) + len(begin)] + "\n" + text.rstrip("\n") + "\n" + doc[doc.index(end):])
    return True
