"""grpo: Group Relative Policy Optimization for causal language models."""
