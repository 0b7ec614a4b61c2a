"""The ROS 2 side: the generate node (service, action, lifecycle, diagnostics) and the ask client.
The only room that imports rclpy; it translates parameters, requests and results.

May import: config, runtime.
"""
