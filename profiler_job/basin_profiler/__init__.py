"""Load generation for Basin: the session replay client (`basin replay`, `replay`), the live profiling ramp
(`ramp`: stepped load, settle detection, the shared κ/λc fit), the ConfigMap and Event writer
(`configmap`), the profile figure (`plot`), and the Job entrypoint (`python -m basin_profiler`, `job`)."""
