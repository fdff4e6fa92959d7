"""What the framework bindings (bps_gc.torch, bps_gc.mxnet) share, in numpy."""
