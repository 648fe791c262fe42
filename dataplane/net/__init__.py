"""The transports shared by the software switch and the SmartNIC engine: `transport` (the one
interface every kind implements, and the factories), `mmsg` (batched UDP and AF_PACKET sockets),
`shm_ring` / `shm_endpoint` (shared-memory packet rings), `framing` (local control channels)."""
