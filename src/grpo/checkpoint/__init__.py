"""Checkpoints: writing and reading in one package.

- `store`: a `checkpoint-{step}/` or `final_model/` directory written atomically with its manifest (or
  linked to the last checkpoint's files), verified, listed, pruned, read back (the Hugging Face layout
  plus `training_state.pt`).
- `policy`: the policy's weights into and out of such a directory, sharded (FSDP2) or LoRA.

What a run saves when, and resume itself, are in run/lifecycle.py (its clock and messages live there).
"""
