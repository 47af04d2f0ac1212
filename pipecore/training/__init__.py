"""Training surface: data x pipeline parallel, DDP/FSDP2 stages, tied weights, clipping,
checkpoints, the dp x pp mesh, and the one gradient finalisation after a step."""
