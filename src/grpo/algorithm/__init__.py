"""Pure tensor math of GRPO: advantages, losses, filters. Imports nothing from config, models or I/O."""
