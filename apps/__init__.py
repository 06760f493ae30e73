"""End-user applications built on cortexstream (the Textual TUI lives in `apps.tui`)."""
