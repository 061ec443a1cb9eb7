"""Prompts in: data sources and the Grain pipeline (pipeline), tokenizers, the synthetic tasks, and the
collector that stamps each prompt with its ordinal and keeps the snapshots a frontier restore needs."""
