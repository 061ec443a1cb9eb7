"""GRPO's math: the token distribution sampled from and scored under (sampling), group advantages,
the policy losses, rewards, and the learner's jitted step."""
