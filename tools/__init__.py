"""Developer tools for solverkit (tools/README.md)."""
