"""The tensor-parallel group: the head's executor, the workers, control frames, set-up, local launch."""
