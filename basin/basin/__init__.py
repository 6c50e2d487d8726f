"""Basin: the model of the paper, free of HTTP and Kubernetes.

Workloads and traces, the controller policy and baselines, the predictor, the fluid model, the κ fit,
the discrete-event simulator and the evaluation metrics live here. Components (gateway, operator,
emulator, engine extension, profiler) import this package, never each other.
"""

__version__ = "0.1.0"
