"""The results stage: cost metrics, percentiles and progress, and the end-of-demo report."""
