"""Engine adapters. Each imports the core and its own engine, never another adapter."""

__all__: list[str] = []  # the modules are the API: import from them
