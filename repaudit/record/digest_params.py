"""The row digest's constants (splitmix64's), shared by every implementation of it: the numpy
reference and the torch version in digest.py, the Triton kernel in digest_kernel.py."""

SEED = 0x5EED_0F_7B1C
GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
TABLE_MAX_ROWS = 65535  # digest_kernel.digest_many's rows: its grid's second axis (a decode step's batch)
