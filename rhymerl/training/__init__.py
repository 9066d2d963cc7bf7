"""Training: SFT of the base model, the RL loop, and its algorithms."""
