"""Benchmark harnesses behind `recipes bench`: scaffolding, not library code (training code
imports `recipes.<domain>`, never this)."""
