"""twinkle.infra: where components run (device groups) and how their ranks split the work (device meshes)."""

from twinkle.infra.mesh import DeviceGroup, DeviceMesh
from twinkle.infra.placement import get_device_placement
from twinkle.infra.runtime import Runtime, get_runtime

__all__ = ['DeviceGroup', 'DeviceMesh', 'Runtime', 'get_device_placement', 'get_runtime']
