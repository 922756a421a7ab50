"""The speed model behind `tandem plan`: predicted decode time per layout, and the lockstep probe."""
