"""The policy: the transformer (Qwen2/Llama), Hugging Face checkpoints in and out (hf, safetensors_io),
and LoRA adapters."""
