"""Checkpoints: writing, reading and resume in one package.

- `store`: a `checkpoint-{step}/` or `final_model/` directory written atomically with its manifest,
  verified, listed, pruned, read back (the Hugging Face layout plus `training_state.pt`).
- `policy`: the policy's weights into and out of such a directory, sharded (FSDP2) or LoRA.
- `resume`: what a run saves at a checkpoint and at its end, and a run restored from one.
"""
