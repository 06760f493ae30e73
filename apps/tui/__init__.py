"""`cortexstream tui`: chat with several conversations at once and watch the KV block arena live.

The source lives in `apps/tui/` of the repository and installs as `cortexstream.tui` (pyproject.toml maps it at
build time), so a wheel and an editable checkout import it by the same name.
"""
