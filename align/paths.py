"""Where the shipped files live (the repository's data/ folder, beside the align package), and how a data option
names a split of a dataset."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data"
TOKENIZER_DIR = DATA_DIR / "tokenizer"

# PATH_OR_NAME:SPLIT: the shortest head whose tail is a split name (train, test, validation_1, train[:10%])
_SPLIT = re.compile(r"(?P<head>.+?):(?P<split>[A-Za-z_][\w.-]*(?:\[[^\]]*\])?)")


def split_spec(spec: str) -> tuple[str, str]:
    """A data option's 'PATH_OR_NAME[:SPLIT]' -> (PATH_OR_NAME, SPLIT, '' when none). A path that exists as
    written wins (a file whose name holds a ':'), and a tail that is no split name stays part of the path (a
    Windows drive, C:\\data\\train.jsonl)."""
    if not spec or ":" not in spec or Path(spec).exists():
        return spec, ""
    m = _SPLIT.fullmatch(spec)
    return (m["head"], m["split"]) if m else (spec, "")
