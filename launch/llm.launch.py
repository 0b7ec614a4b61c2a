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

A params_file that is not a readable file is refused before the node starts, and a node process that fails
(exits non-zero: a bad parameter, a port in use, an engine that does not load) ends the launch with exit status 1
and the reason (launch turns an exception raised in its actions and handlers into status 1; a Shutdown event
alone would end it with 0).
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.event_handlers import OnProcessExit
from launch.conditions import IfCondition, UnlessCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration, PythonExpression
from launch_ros.actions import LifecycleNode, Node
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition


def check_params_file(context):
    """Refuse a params_file that is not a readable file (launch_ros only warns and starts the node without it: the
    embedded default profile would serve instead of the one asked for)."""
    path = LaunchConfiguration("params_file").perform(context)
    if not (os.path.isfile(path) and os.access(path, os.R_OK)):
        why = "does not exist" if not os.path.exists(path) else (
            "is not a file" if not os.path.isfile(path) else "cannot be read")
        raise RuntimeError(f"params_file:={path} {why}: give the path of a readable ROS 2 parameters file "
                           f"(/**: ros__parameters:, e.g. a profile of share/spec_edge/config/), or leave params_file "
                           f"unset for the default profile; the node was not started")
    return []


def node_failed(event, context):
    """The node's process ended non-zero while launch was not shutting down: end the launch with status 1."""
    if event.returncode != 0 and not context.is_shutdown:
        raise RuntimeError(f"the spec_edge node exited with status {event.returncode}: its "
                           f"log above says why; launch ends with it")


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
        OpaqueFunction(function=check_params_file),  # before any node: its exception ends launch with status 1
        node,
        lifecycle_node,
        RegisterEventHandler(OnProcessExit(target_action=lambda action: action in (node, lifecycle_node),
                                           on_exit=node_failed)),
        # configured -> activate, once: only after the configure emitted below (a manager's later
        # deactivate stays deactivated, its cleanup -> configure -> activate is its own)
        RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=lifecycle_node, start_state="configuring", goal_state="inactive",
            entities=[transition(Transition.TRANSITION_ACTIVATE)], handle_once=True), condition=launch_drives),
        transition(Transition.TRANSITION_CONFIGURE, condition=launch_drives),
    ])
