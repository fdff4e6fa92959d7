"""The parameter server transport (ZeroMQ): scheduler, servers, workers and the membership they share."""
