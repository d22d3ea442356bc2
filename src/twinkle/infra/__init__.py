"""twinkle.infra: where components run (device groups) and how their ranks split the work (device meshes)."""

from twinkle.infra.mesh import DeviceGroup, DeviceMesh, get_device_placement

__all__ = ['DeviceGroup', 'DeviceMesh', 'get_device_placement']
