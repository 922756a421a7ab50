"""The pipeline: the head's executor, stage processes and loops, stage frames and links, layout, launch."""
