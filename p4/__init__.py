"""Locates the P4 sources and their committed build artifacts (P4Info, runtime JSON)."""

from pathlib import Path

P4_DIR = Path(__file__).resolve().parent
BUILD_DIR = P4_DIR / "build"
P4INFO_TXTPB = BUILD_DIR / "p4info.txtpb"
