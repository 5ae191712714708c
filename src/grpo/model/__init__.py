"""The policy model: loading (hub/local/bundled), LoRA, and the native Llama-family decoder (block math,
rollout decode, packed training forward, oneDNN linears) that runs on the HF model's live weights."""
