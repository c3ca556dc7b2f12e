"""The GPU campaign (``bash experiments/gpu/campaign.sh``; docs/gpu.md): what the simulator predicts for GPUs,
measured on one GPU in one short window. campaign.py runs the steps; plan.py prices them; checks.py and timings.py
are the steps."""
