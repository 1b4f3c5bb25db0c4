"""Benchmarks (`make bench`); each writes its results under bench/results/."""
