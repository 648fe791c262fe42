"""Locates the P4 sources and their committed build artifacts (P4Info, runtime JSON)."""

# defined once, with the P4Runtime facts the controller and the switches share
from luwu.dataplane.p4runtime import BUILD_DIR, P4_DIR, P4INFO_TXTPB

__all__ = ["BUILD_DIR", "P4INFO_TXTPB", "P4_DIR"]
