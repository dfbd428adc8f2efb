"""Where recipes look for local data by default: ../shared/data next to the repo."""

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
