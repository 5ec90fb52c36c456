"""Admission orchestration: resolve the catalog, run the pure ladder, reserve, record the manifest; replay."""
