"""DeepSpeed engines for actor, critic and reference, and the DeepSpeed config they are built from."""
