"""A decode step's grouped-query attention with its cache write in one Pallas (Triton) kernel: ``triton.py``."""
