"""Load generation for Basin: the session replay client (`basin replay`); the profiling Job's ramp and
ConfigMap writer build on it."""
