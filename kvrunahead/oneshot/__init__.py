"""One-shot runs: a prompt prefilled once and reported. ``runner`` times a mode on joined ranks (the peers'
harness and kvr-prefill's path), ``on_engine`` runs kvr-prefill's and kvr-ask's requests through the serving
engine, ``batch`` is a batch of prompts (its checks, report and the padded baseline), ``ask`` is kvr-ask's report."""
