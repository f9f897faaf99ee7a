"""Averaging: matchmaking that follows no left-out leader, the robust all-reduce, and the guarded averagers."""
