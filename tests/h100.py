"""The recorded outputs of a real H100 host (tests/fixtures/h100-host; its README says what each file is)."""
from pathlib import Path

FIX = Path(__file__).parent / "fixtures" / "h100-host"


def read(name: str) -> str:
    return (FIX / name).read_text()
