"""Long-running reliability runs (not tests): see crash_soak.py."""
