"""One rank's assignments sorted by slot in one Pallas (Triton) kernel: ``triton.py``; its reference is ``moe._ranks``."""
