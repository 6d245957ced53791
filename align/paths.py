"""Where the shipped files live (the repository's data/ folder, beside the align package)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data"
TOKENIZER_DIR = DATA_DIR / "tokenizer"
