"""sign and signnorm on the device: onebit without and with scaling under their own names
(compress/signs.py), float32 and float16 partitions only."""
from ..signs import Sign, SignNorm
from .onebit import DeviceOnebit
from .registry import register_device_compressor


@register_device_compressor("signnorm")
class DeviceSignNorm(DeviceOnebit):
    host_class = SignNorm
    reducers = SignNorm.reducers


@register_device_compressor("sign")
class DeviceSign(DeviceOnebit):
    host_class = Sign
    reducers = Sign.reducers
