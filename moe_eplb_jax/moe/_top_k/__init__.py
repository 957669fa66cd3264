"""The router's top-k and the scores it picks in one Pallas (Triton) kernel: ``triton.py``; its reference is ``moe._ranks``."""
