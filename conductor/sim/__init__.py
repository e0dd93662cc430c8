"""Trace-replay cluster simulator that runs the scheduler core (see docs/SCHEDULER.md)."""
