"""Start the spec_edge node: `ros2 launch spec_edge llm.launch.py [params_file:=FILE] [namespace:=NS]`.

params_file defaults to the installed share/spec_edge/config/default.yaml. The node (a lifecycle
node) configures and activates itself at start; run `generate_server --no-autostart` instead where
a lifecycle manager drives it.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("spec_edge"), "config", "default.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="ROS 2 parameters file (/**: ros__parameters:) of the node"),
        DeclareLaunchArgument("namespace", default_value="",
                              description="namespace of the node and its generate service/action"),
        Node(package="spec_edge", executable="generate_server", name="spec_edge",
             namespace=LaunchConfiguration("namespace"),
             parameters=[LaunchConfiguration("params_file")],
             output="screen", emulate_tty=True),
    ])
