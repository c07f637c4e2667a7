"""vkattn perf scripts: ``python -m perf`` runs decode, prefill and append cases (docs/perf.md)."""
