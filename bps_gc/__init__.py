"""bps_gc: a BytePS-style parameter server with gradient compression."""
__version__ = "0.1.0"
