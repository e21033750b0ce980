"""The command line's Typer apps, apart from the library code they call (`titans.cli` is the root app)."""
