"""What a run keeps across restarts: the prompt ledger (events.jsonl) and its audit, the replay buffer of
finished groups, Orbax checkpoints, the run-directory lock, and append-only line files."""
