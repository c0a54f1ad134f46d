"""Comparing records: the diff of two records (diff.py and the modules it reads through), the
verdict, the RL mismatch metrics."""
