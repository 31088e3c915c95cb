"""Engine adapters. Each imports the core and its own engine, never another adapter."""
