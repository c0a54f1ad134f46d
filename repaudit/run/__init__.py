"""The run stage: plan the matrix, launch each group as a job, run the engines in the workers,
keep the run directory (manifest, events, records)."""
