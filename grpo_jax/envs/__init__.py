"""Multi-turn environments and tool calls, host-side and JAX-free: the Environment interface and its config
(environment), tools as plain Python functions (tools), a renderer per model family that turns a conversation
into token ids as the family's chat template does (render), and the trajectory of an episode with its loss mask
(trajectory). Three built-in environments, named in an EnvConfig by short name: gsm8k_python (gsm8k),
countdown_multiturn and fetch_code (synthetic). grpo_jax.rollout.episodes runs them."""
