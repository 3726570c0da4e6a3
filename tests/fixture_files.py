"""Where the files under tests/fixtures that several test modules load are."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CUSTOM_LOSSES = FIXTURES / "custom_losses.py"  # a custom loss and a custom advantage, loaded by path
