"""Mininet topologies (star, multi-rack, rail-only) and the emulation runner."""
