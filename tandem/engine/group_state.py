"""The words a group's health reason starts with, shared by the head that says them
(`tandem.engine.recovery`) and the supervisor that reads them from `/health` (`tandem launch`).

A module of constants only: `tandem launch` imports it without numpy or torch.
"""

REFORMING = "re-forming"  # the group broke and is forming again: wait
FAILED = "failed"  # the re-form gave up: shut down
