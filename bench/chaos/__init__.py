"""The chaos suite: faults injected into real components on loopback (`python -m bench.chaos`, `make chaos`)."""
