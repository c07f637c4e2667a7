"""vkattn perf scripts: ``python -m perf`` runs decode, prefill and append cases (see README)."""
