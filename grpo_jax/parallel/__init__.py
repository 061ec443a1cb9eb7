"""Devices and processes: meshes and the actor/learner device cut (sharding), several JAX processes and
the bounded agreements between them (distributed). No model, no data."""
