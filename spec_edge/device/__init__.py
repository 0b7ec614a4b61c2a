"""TensorRT on the robot (Jetson AGX Thor): engine specs, builds, manifests and the memory plan
(spec-edge build / plan, the build_engines executable).

May import: config, graphs, heads.
"""
