"""hivemind.Optimizer extended: the bounded progress tracker, the guarded optimizer, DiLoCo, and the accessors
the trainer, the aux peer and the stopping rules ask.
"""
