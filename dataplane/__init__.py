"""The data plane: wire protocol, batched sockets, the software switch, the SmartNIC engine and the in-network optimizer node it hosts."""
