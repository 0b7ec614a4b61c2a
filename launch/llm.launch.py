"""Start the spec_edge node: `ros2 launch spec_edge llm.launch.py [params_file:=FILE] [namespace:=NS]
[managed:=true [autostart:=false]] [http:=true]`.

params_file defaults to the installed share/spec_edge/config/default.yaml: the default profile, the
defaults of spec_edge/config.py that `spec-edge serve` and the CLI run without options.

- managed:=false (the default): the node (a lifecycle node) configures and activates itself at start.
- managed:=true: the node starts unconfigured as a launch LifecycleNode; with autostart:=true (the
  default) launch drives it through configure and activate once at start, with autostart:=false it waits for a
  lifecycle manager (e.g. nav2_lifecycle_manager with node_names: [spec_edge]).
- http:=true: the node also serves the OpenAI-compatible HTTP door (http.enabled; http.host, http.port and
  http.api_key from the params file). Under launch this argument sets http.enabled, whatever the params file says.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.conditions import IfCondition, UnlessCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration, PythonExpression
from launch_ros.actions import LifecycleNode, Node
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("spec_edge"), "config", "default.yaml")
    managed = LaunchConfiguration("managed")
    launch_drives = IfCondition(PythonExpression(
        ["'", managed, "'.lower() == 'true' and '", LaunchConfiguration("autostart"), "'.lower() == 'true'"]))
    common = dict(package="spec_edge", executable="generate_server", name="spec_edge",
                  namespace=LaunchConfiguration("namespace"),
                  parameters=[LaunchConfiguration("params_file"), {"http.enabled": LaunchConfiguration("http")}],
                  output="screen",
                  # a pipe, not a pseudo-terminal: progress arrives as plain lines (no redrawn bars)
                  additional_env={"PYTHONUNBUFFERED": "1"})
    node = Node(condition=UnlessCondition(managed), **common)
    lifecycle_node = LifecycleNode(condition=IfCondition(managed), arguments=["--no-autostart"], **common)

    def transition(transition_id, **kwargs):
        return EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(lifecycle_node),
                                           transition_id=transition_id), **kwargs)

    return LaunchDescription([
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="ROS 2 parameters file (/**: ros__parameters:) of the node"),
        DeclareLaunchArgument("namespace", default_value="",
                              description="namespace of the node and its generate service/action"),
        DeclareLaunchArgument("managed", default_value="false", choices=["true", "false"],
                              description="false: the node configures and activates itself; true: a launch "
                                          "LifecycleNode driven by launch (autostart) or a lifecycle manager"),
        DeclareLaunchArgument("autostart", default_value="true", choices=["true", "false"],
                              description="with managed:=true, launch configures and activates the node"),
        DeclareLaunchArgument("http", default_value="false", choices=["true", "false"],
                              description="true: also serve the OpenAI-compatible HTTP door (http.enabled)"),
        node,
        lifecycle_node,
        # configured -> activate, once: only after the configure emitted below (a manager's later
        # deactivate stays deactivated, its cleanup -> configure -> activate is its own)
        RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=lifecycle_node, start_state="configuring", goal_state="inactive",
            entities=[transition(Transition.TRANSITION_ACTIVATE)], handle_once=True), condition=launch_drives),
        transition(Transition.TRANSITION_CONFIGURE, condition=launch_drives),
    ])
