"""Datagram I/O shared by the software switch and the SmartNIC engine."""
