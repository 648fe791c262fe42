"""The long-running processes behind `luwu switch`, `luwu engine` and `luwu node`: argument
parsing, wiring to the controller, signals. They sit in the application layer because they import
the controller's client; what they run lives in luwu.dataplane."""
