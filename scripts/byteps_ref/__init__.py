"""BytePS's own codecs as the reference of scripts/bench_codecs.py (reference.py)."""
