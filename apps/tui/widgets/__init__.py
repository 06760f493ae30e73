"""Widgets of the CortexStream TUI."""
