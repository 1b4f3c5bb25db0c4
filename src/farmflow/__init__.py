"""farmflow: AlpacaFarm rebuilt as a Prefect-orchestrated, cached pipeline.

Start with `farmflow demo` (CLI) or `farmflow.flows.best_of_n_flow` (Python); the map of
the packages is in docs/architecture.md.
"""

__version__ = "0.1.0"
