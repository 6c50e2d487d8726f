"""An SGLang-compatible PD engine emulator: SGLang's HTTP API and metrics over Basin's calibrated engine
model, for tests, profiling and the local stack without GPUs. It runs no model; it says so."""
