"""Prepacking over the KV chain: many prompts prefilled as one packed sequence (positions restarting at each
prompt, each token attending to its own prompt only), cut into rank parts balanced over the packed work and
preferring prompt edges, bin-packed into steps first-fit decreasing (Zhao et al., Prepacking, sections 3-4).

``plan`` decides (bins, cuts; no torch), ``chain`` runs one rank's part of a packed step, ``batch`` runs a batch
of prompts on ranks that have joined and reports each prompt."""
