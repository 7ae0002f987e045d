"""Tools that run the engine to measure or tune a strategy: DSpark calibration, the
self-drafting layer scan, trace plots."""
