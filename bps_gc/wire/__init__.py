"""ZeroMQ framing: a fixed binary header plus raw payload frames; no pickle anywhere."""
