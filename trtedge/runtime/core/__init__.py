"""Engine bookkeeping: requests, scheduling, KV blocks, hybrid-state snapshots. No torch here (a test asserts it)."""
