"""The Basin Kubernetes operator: BasinDeployment resources into SGLang PD engines, router, gateway, Redis
and profiling Jobs. Run it with `basin operator run` (or `python -m basin_operator` in a container)."""
