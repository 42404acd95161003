"""The shipped demo models (target/, draft/) and their training texts, as package data."""

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
