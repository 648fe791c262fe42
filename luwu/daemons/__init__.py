"""The long-running processes behind `luwu switch`, `luwu node` and `luwu bmv2`: argument parsing,
wiring to the controller, signals. They sit in the application layer because they import the
controller's client or start outside programs; what they run lives in luwu.dataplane (or is BMv2).
The daemons a lower layer starts live with what starts them: the engine daemon
(dataplane/engine/daemon.py) and the loopback switch's process (dataplane/loopback/daemon.py)."""
