"""The ROS 2 node: parameters -> Config, requests -> the decoder (through the scheduler), results -> responses.

One lifecycle node ("spec_edge", executable `generate_server`) owns one Engine:

- configure: parameters (declared from spec_edge.config's defaults, one per key) -> Config ->
  artifacts.engine (the graphs made where missing, then loaded); cleanup frees the engine again.
- activate / deactivate: the `generate` service (spec_edge_interfaces/srv/Generate), the
  `generate` action (spec_edge_interfaces/action/Generate, streaming text deltas as feedback) and
  `~/tokenize` (spec_edge_interfaces/srv/Tokenize: text -> ids, ids -> text) serve, or refuse with a message. Both feed one FIFO queue served by one worker thread, which admits
  requests into the engine's graphs.batch_slots slots; a request arriving while the node holds
  batch_slots + serve.queue_limit (running or waiting) is answered "busy" at once; a request older than
  serve.request_timeout_s ends with finish_reason "error". speculative.k auto chooses each
  request's k per iteration (serve.speculate_k_by_load on TensorRT: the k per load, 0 = target-only):
  stats carry queued_at_start, verify_calls_by_k and speculation_off_reason; /diagnostics the call costs
  each request's k is chosen from (k_choice; on TensorRT the table).
- parameters (spec_edge.ros2.parameters): one typed, described ROS parameter per config key; all are
  read at configure, so a set is refused while the node holds an engine (cleanup, set, configure).
- shutdown (from any state, or on SIGINT / SIGTERM) frees the engine as cleanup does; a finalized node
  answers every request that it is shutting down.
- http.enabled: the OpenAI-compatible HTTP door (spec_edge/http/) on http.host:http.port, from configure to cleanup,
  onto the same scheduler as the ROS interfaces (503 while the engine loads and while the node is not active).
- `/diagnostics` (diagnostic_msgs/DiagnosticArray) every serve.diagnostics_period_s: memory_bytes is
  the RSS now (memory_peak_bytes the peak), memory_pss_bytes its Pss, memory_anon_bytes the private
  anonymous memory (the one to watch, docs/ros.md) and memory_file_bytes the resident pages of mapped files
  (the weights); cleanup gives the engine's memory back to the OS.

Everything the node knows about generation comes from the Engine; it only translates
(spec_edge.ros2.messages) and queues (spec_edge.runtime.scheduler).
"""
from __future__ import annotations

import argparse
import array
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor, ParameterType, SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.parameter import Parameter
from spec_edge_interfaces.action import Generate as GenerateAction
from spec_edge_interfaces.srv import Generate as GenerateSrv
from spec_edge_interfaces.srv import Tokenize as TokenizeSrv

from spec_edge import config as cfgmod
from spec_edge.ros2 import memory, parameters
from spec_edge.ros2.messages import Outcome, fill_response, to_engine_request, tokenize
from spec_edge.ros2.shutdown import exit_process, exit_while_configuring, leave_graph, start_watchdog, unless_stopped
from spec_edge.runtime.requests import RequestError
from spec_edge.runtime.scheduler import SHUTTING_DOWN, Job, Scheduler
from spec_edge.runtime.serving import Decoder

if TYPE_CHECKING:
    from spec_edge.http.door import Door

NODE_NAME = "spec_edge"
SERVICE_NAME = "generate"   # relative: /generate, or /<namespace>/generate
ACTION_NAME = "generate"
TOKENIZE_NAME = "~/tokenize"  # private: /spec_edge/tokenize, or /<namespace>/spec_edge/tokenize
# History depth of the generate endpoints (service requests/responses, action services, feedback).
# ROS's default of 10 drops requests when more than 10 arrive at once (they are taken only as
# executor threads free up) and drops feedback deltas a slow client has not read yet.
QOS_DEPTH = 256
# why the node does not serve yet (the HTTP door's 503, /health): the mode decides what it waits for
INACTIVE = ("the node is inactive, not active: it serves once it is activated (by its lifecycle manager, or "
            "`ros2 lifecycle set <node> activate`)")
STARTING = "the node is starting: it activates itself once the engine is loaded; retry shortly"
# Parameters ROS itself may receive as overrides without the node declaring them
ROS_PARAMETER_PREFIXES = ("qos_overrides.", "use_sim_time", "start_type_description_service")


# ---------------------------------------------------------------------------------------------
# Endpoint QoS (the client uses the same)


def endpoint_qos():
    """The QoS of the generate service, the action's services and its feedback (both sides)."""
    import copy

    from rclpy.qos import qos_profile_services_default
    qos = copy.copy(qos_profile_services_default)
    qos.depth = QOS_DEPTH
    return qos


def feedback_qos():
    """The QoS of the action's feedback topic (both sides): endpoint_qos() whose history of the last QOS_DEPTH
    messages also reaches a reader matched after they were sent (transient local). Discovery is not
    symmetric: a fresh client can see the node's feedback writer, and have its goal accepted and answered,
    before that writer has matched the client's reader; a short goal's feedback sent in that gap is
    delivered once the match completes instead of being lost. A volatile reader (ROS's default, e.g.
    `ros2 action send_goal --feedback`) still matches and gets what is sent after its match."""
    from rclpy.qos import DurabilityPolicy
    qos = endpoint_qos()
    qos.durability = DurabilityPolicy.TRANSIENT_LOCAL
    return qos


def action_qos_kwargs(feedback_key: str) -> dict[str, Any]:
    qos = endpoint_qos()
    return {"goal_service_qos_profile": qos, "result_service_qos_profile": qos,
            "cancel_service_qos_profile": qos, feedback_key: feedback_qos()}


# ---------------------------------------------------------------------------------------------
# Parameters


def _param_value(value: Any, default: Any) -> Any:
    """A ROS parameter value -> the plain Python value spec_edge.config expects. An empty list has no
    ROS type: rclpy declares and reads it as an unset parameter (None), which is [] for a list key."""
    if isinstance(value, (array.array, tuple)):
        return list(value)
    if value is None and isinstance(default, list):
        return []
    return value


# ---------------------------------------------------------------------------------------------
# The node


class GenerateNode(LifecycleNode):
    """spec_edge's lifecycle node; see the module docstring. State: cfg (read at configure), decoder (the loaded
    serving.Decoder, from configure to cleanup), scheduler (the one Scheduler onto it: the front, the queue),
    door (the HTTP door, http.enabled)."""

    def __init__(self, autostart: bool = False, **kwargs):
        """autostart: the node configures and activates itself (run()), so until then it waits for nothing
        else; without, for a lifecycle manager."""
        super().__init__(NODE_NAME, **kwargs)
        self.starting = autostart  # until the first activate: what /health and refusals say it waits for
        self._group = ReentrantCallbackGroup()
        self.cfg: cfgmod.Config | None = None
        self.decoder: Decoder | None = None
        self.scheduler: Scheduler | None = None
        self.door: Door | None = None  # the HTTP door (http.enabled), from configure to cleanup
        self._info: dict[str, Any] = {}
        self._active = False
        self._diag_timer = None
        self.configuring = False  # on_configure is running (a first start's export can take minutes)
        self.exiting = False  # the process ends after this shutdown (a signal): exit fast, free nothing more
        self._override_errors: dict[str, str] = {}  # params-file values of the wrong type
        for name, (default, descriptor) in parameters.descriptors(ParameterDescriptor, ParameterType).items():
            self._declare(name, default, descriptor)
        self.add_pre_set_parameters_callback(self._coerce_parameters)
        self.add_on_set_parameters_callback(self._check_parameters)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        # The endpoints live as long as the node and refuse requests unless it is active:
        # destroying an action server while a multi-threaded executor waits on it crashes rclpy.
        self._service = self.create_service(GenerateSrv, SERVICE_NAME, self._on_service,
                                            qos_profile=endpoint_qos(), callback_group=self._group)
        self._tokenize = self.create_service(TokenizeSrv, TOKENIZE_NAME, self._on_tokenize,
                                             qos_profile=endpoint_qos(), callback_group=self._group)
        self._action = ActionServer(
            self, GenerateAction, ACTION_NAME, execute_callback=self._on_goal_execute,
            goal_callback=lambda goal: GoalResponse.ACCEPT,
            cancel_callback=lambda handle: CancelResponse.ACCEPT,
            callback_group=self._group, **action_qos_kwargs("feedback_pub_qos_profile"))

    # -- parameters -------------------------------------------------------------------------

    def _declare(self, name: str, default: Any, descriptor: Any) -> None:
        """Declare one parameter with its own descriptor and static type. An override of another
        type is converted where that is lossless (120 for a double), else kept out and reported at
        configure; an empty-list default is declared as an empty array of its element type."""
        kind = Parameter.Type(descriptor.type)
        set_empty = False  # an empty array has no type of its own: declared, then set as a typed []
        override = self._parameter_overrides.get(name)
        if override is not None and override.type_ != kind:
            value = parameters.coerce(override.value, descriptor.type, ParameterType)
            if value is None:
                self._override_errors[name] = (f"{name} must be {parameters.type_name(descriptor.type, ParameterType)}"
                                               f", got {override.value!r}")
            if value is None or value == []:
                del self._parameter_overrides[name]
                set_empty = value == []
            else:
                self._parameter_overrides[name] = Parameter(name, kind, value)
        if isinstance(default, list) and not default:
            self.declare_parameter(name, kind, descriptor)   # typed, unset unless overridden
            set_empty = set_empty or name not in self._parameter_overrides
        else:
            self.declare_parameter(name, default, descriptor)
        if set_empty:
            self.set_parameters([Parameter(name, kind, [])])

    def _coerce_parameters(self, params: list) -> list:
        """Before a set: values of another type that convert losslessly (ros2cli sends `[]` as a
        bool array, `120` as an integer) take the declared type; the rest fail its type check."""
        out = []
        for p in params:
            if self.has_parameter(p.name):
                want = self.describe_parameter(p.name).type
                value = parameters.coerce(p.value, want, ParameterType)
                if value is not None and p.type_.value != want:
                    p = Parameter(p.name, Parameter.Type(want), value)
            out.append(p)
        return out

    def _current_params(self) -> dict[str, Any]:
        defaults = cfgmod.to_params(cfgmod.Config())
        return {name: _param_value(self.get_parameter(name).value, default) for name, default in defaults.items()}

    def _check_parameters(self, params: list) -> Any:
        ours = [p.name for p in params if p.name in self._override_errors or self.has_parameter(p.name)
                and not p.name.startswith(ROS_PARAMETER_PREFIXES)]
        if ours and (self.decoder is not None or self.configuring):
            return SetParametersResult(successful=False, reason=(
                f"{', '.join(ours)}: the node is {self.state_name()}; spec_edge's parameters are "
                f"{parameters.APPLIES} (ros2 lifecycle set {self.get_fully_qualified_name()} ...)"))
        merged = self._current_params()
        merged.update({p.name: _param_value(p.value, merged[p.name]) for p in params if p.name in merged})
        try:
            cfgmod.from_params(merged)
        except cfgmod.ConfigError as err:
            return SetParametersResult(successful=False, reason=str(err))
        for p in params:  # a value of the right type replaces a params file's wrong one
            self._override_errors.pop(p.name, None)
        return SetParametersResult(successful=True)  # used from the next configure on

    # -- lifecycle --------------------------------------------------------------------------

    def _unknown_overrides(self) -> dict[str, Any]:
        """Overrides from params files / -p that name no parameter of this node (a typo such as
        speculative.drafterr): rclpy ignores them silently, `spec-edge serve --params` refuses them."""
        overrides = self._parameter_overrides  # rclpy keeps them only here (no public getter)
        return {name: _param_value(p.value, None) for name, p in overrides.items()
                if not self.has_parameter(name) and not name.startswith(ROS_PARAMETER_PREFIXES)}

    def on_configure(self, state):
        self.configuring = True
        try:
            return self._configure()
        finally:
            self.configuring = False

    def _configure(self):
        if self._override_errors:
            self.get_logger().error(f"configure: {'; '.join(self._override_errors.values())}")
            return TransitionCallbackReturn.FAILURE
        try:
            self.cfg = cfgmod.from_params({**self._current_params(), **self._unknown_overrides()})
        except cfgmod.ConfigError as err:
            self.get_logger().error(f"configure: {err}")
            return TransitionCallbackReturn.FAILURE
        self.get_logger().info(f"loading engine: target={self.cfg.model.target} backend={self.cfg.runtime.backend} "
                               f"drafter={self.cfg.speculative.drafter} k={self.cfg.speculative.k}")
        started = time.monotonic()
        if self.cfg.http.enabled:  # up while the engine loads (answering 503), so a client sees it coming
            from spec_edge.http.door import Door
            try:
                self.door = Door(self.cfg, self.get_logger()).start()
            except cfgmod.ConfigError as err:  # a reachable address without api_key, a port in use
                self.get_logger().error(f"configure: the HTTP door did not start: {err}")
                return TransitionCallbackReturn.FAILURE
        try:
            from spec_edge import artifacts
            self.decoder = artifacts.engine(self.cfg, progress=self.get_logger().info)
            self._info = dict(self.decoder.info())
            self.scheduler = Scheduler(self.decoder, self.cfg, self.get_logger())
            if self.cfg.serve.warm_system_prompt:  # the system prompt's rows, for every request to reuse
                self.get_logger().info(f"warmed the cache with the system prompt: {self.scheduler.warm()} tokens")
        except Exception as err:  # a missing model, a refused memory plan, a failed build
            self.get_logger().error(f"configure: engine did not load: {err}")
            self._unload()
            return TransitionCallbackReturn.FAILURE
        if self.door is not None:
            self.door.pause(STARTING if self.starting else INACTIVE)
        self._diag_timer = self.create_timer(self.cfg.serve.diagnostics_period_s,
                                             self.publish_diagnostics, callback_group=self._group)
        self.get_logger().info(f"engine loaded in {time.monotonic() - started:.1f} s: {self._info} "
                               f"(RSS {memory.rss_bytes() / 1e6:.0f} MB)")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state):
        self._active, self.starting = True, False
        if self.door is not None:
            self.door.serve(self.scheduler)
        self.get_logger().info(f"serving {self.resolve_service_name(SERVICE_NAME)} (service and action)")
        return super().on_activate(state)

    def on_deactivate(self, state):
        self._active = False
        if self.door is not None:
            self.door.pause(INACTIVE)
        return super().on_deactivate(state)

    def on_cleanup(self, state):
        self._unload()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state):
        """Frees the engine as cleanup does: a finalized node may stay up (ros2 lifecycle set ... shutdown
        without a signal), and it answers every request that it is shutting down."""
        self._active = False
        self._unload(release=not self.exiting)  # a process about to end has nothing to hand back
        return TransitionCallbackReturn.SUCCESS

    def _unload(self, timeout: float = 1.0, release: bool = True):
        """Stop serving and free the engine. release False (the process ends next, within the 2 s of a
        signal): the scheduler and the door's thread are not waited for and the engine not closed (the OS takes
        them at once; a decode call on a loaded machine, a close of the ONNX Runtime sessions or a graceful HTTP
        shutdown can each take most of a second)."""
        if self._diag_timer is not None:
            self.destroy_timer(self._diag_timer)
            self._diag_timer = None
        if self.door is not None:
            self.door.pause(SHUTTING_DOWN)
        if self.scheduler is not None:
            self.scheduler.stop(timeout if release else 0.0)  # (exiting: stop_generation waited for it already)
            self.scheduler = None
        if self.door is not None:
            self.door.stop(timeout=3.0 if release else 0.0)
            self.door = None
        if self.decoder is not None:
            if release:
                self.decoder.close()
            self.decoder = None
            self._info = {}
            if release:
                memory.release_freed_heap()
                self.get_logger().info(f"engine freed (RSS now {memory.rss_bytes() / 1e6:.0f} MB)")

    def destroy_node(self) -> None:
        """Everything holding the rcl node, so it is finalized and its DDS participant leaves the
        graph: rclpy's destroy_node leaves the action server and the lifecycle state machine."""
        self._action.destroy()
        super().destroy_node()
        self._state_machine.destroy_when_not_in_use()  # rclpy has no public call for it

    def state_name(self) -> str:
        return self._state_machine.current_state[1]  # rclpy has no public getter

    def stop_generation(self, timeout: float) -> None:
        """For signal handling: refuse waiting requests, cancel the running one, join."""
        if self.door is not None:
            self.door.pause(SHUTTING_DOWN)
        if self.scheduler is not None:
            self.scheduler.stop(timeout)

    # -- endpoints ----------------------------------------------------------------------------

    def _not_serving(self) -> str:
        """Why a request is refused while the node is not active."""
        state = self.state_name()
        if state in ("shuttingdown", "finalized"):
            return SHUTTING_DOWN
        if self.starting:
            return STARTING
        return (f"the node is {state}, not active: it serves once it is configured and activated (by its "
                "lifecycle manager, or `ros2 lifecycle set <node> configure`, then `activate`)")

    def _run_job(self, msg: Any, **job_kwargs) -> Outcome:
        scheduler, cfg, decoder = self.scheduler, self.cfg, self.decoder
        if not self._active or scheduler is None or cfg is None or decoder is None:
            return Outcome.refused(self._not_serving(), "unavailable")
        try:
            request = to_engine_request(msg)
        except RequestError as err:  # a field the translation cannot map (an image's format): refused, still serving
            return Outcome.refused(str(err))
        job = Job(request, **job_kwargs)
        if scheduler.submit(job):  # a bad request is refused at once, without taking a place in the queue
            # the scheduler always finishes a job; the margin only guards against a hung engine
            hung = time.monotonic() + cfg.serve.request_timeout_s + 30.0
            while not job.done.wait(0.05):
                if job.cancel_requested():  # a cancelled goal leaves the queue now, not when a slot frees
                    scheduler.withdraw()
                if time.monotonic() > hung:
                    return Outcome(success=False, finish_reason="error",
                                   message="the engine did not return; the node needs a restart")
        return job.outcome

    def _on_tokenize(self, request, response):
        scheduler = self.scheduler
        if not self._active or scheduler is None:
            response.success, response.message = False, self._not_serving()
            return response
        try:
            ids, text = tokenize(scheduler.front, request)
        except RequestError as err:
            response.success, response.message = False, str(err)
            return response
        response.success, response.ids, response.text = True, [int(t) for t in ids], text
        return response

    def _on_service(self, request, response):
        return fill_response(response, self._run_job(request))

    def _on_goal_execute(self, goal_handle):
        def on_text(delta: str, n_tokens: int) -> None:
            goal_handle.publish_feedback(GenerateAction.Feedback(delta=delta, num_tokens=n_tokens))

        outcome = self._run_job(goal_handle.request, on_text=on_text,
                                cancel_requested=lambda: goal_handle.is_cancel_requested)
        result = fill_response(GenerateAction.Result(), outcome)
        if goal_handle.is_cancel_requested and outcome.finish_reason == "cancelled":
            goal_handle.canceled()
        elif outcome.success:
            goal_handle.succeed()
        else:
            goal_handle.abort()
        return result

    # -- diagnostics --------------------------------------------------------------------------

    def publish_diagnostics(self) -> None:
        scheduler, cfg = self.scheduler, self.cfg
        status = DiagnosticStatus(name=f"{self.get_fully_qualified_name()}: generator",
                                  hardware_id=str(self._info.get("backend", "")))
        values: dict[str, Any] = {"state": self.state_name()}
        if scheduler is None or cfg is None:
            status.level, status.message = DiagnosticStatus.WARN, "engine not loaded"
        else:
            depth = scheduler.queue_depth
            values.update(self._info)
            used = memory.breakdown()
            # what changes while serving, as the decoder keeps it now: k auto's call costs, the suffix store's
            # memory, the remote link's state
            live = [key for key in ("k_choice", "suffix_store", "remote") if key in self._info]
            if live and self.decoder is not None:
                now = self.decoder.info()
                values.update({key: now[key] for key in live})
            values.update(memory_bytes=memory.rss_bytes(), memory_peak_bytes=memory.peak_rss_bytes())
            values.update({f"memory_{kind}_bytes": used[kind] for kind in ("pss", "anon", "file") if kind in used})
            values.update(queue_depth=depth, queue_limit=cfg.serve.queue_limit,
                          running=scheduler.current is not None, served=scheduler.served,
                          refused_busy=scheduler.refused_busy, speculation_off=scheduler.speculation_off)
            values.update({f"last_{k}": v for k, v in scheduler.last_stats.items()
                           if isinstance(v, (int, float, str, list))})  # verify_calls_by_k too
            if depth >= cfg.serve.queue_limit:
                status.level, status.message = DiagnosticStatus.WARN, "queue full"
            elif "remote" in values and not values["remote"]["up"]:
                status.level, status.message = DiagnosticStatus.WARN, "remote unavailable" + (
                    ": the local model answers" if cfg.remote.fallback else "")
            else:
                status.level, status.message = DiagnosticStatus.OK, "ready"
        status.values = [KeyValue(key=str(k), value=_diag_str(v)) for k, v in values.items()]
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(msg)


def _diag_str(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ---------------------------------------------------------------------------------------------
# Executables: `generate_server` (ros2 run / launch) and `spec-edge serve`


def run(ros_args: list[str], *, autostart: bool = True) -> int:
    """Start the node, spin until SIGINT/SIGTERM, shut down cleanly. Returns the exit status."""
    import rclpy
    from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    if not sys.stderr.isatty():
        # tqdm bars (the GGUF load's among them) redraw with carriage returns: under ros2 launch,
        # systemd or into a file they arrive as empty lines. Set before anything imports tqdm;
        # the plain "[export] ..." progress lines say what is happening.
        os.environ.setdefault("TQDM_DISABLE", "1")
    rclpy.init(args=["spec_edge", *ros_args], signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()

    def on_signal(signum, frame):
        if not stop.is_set():
            start_watchdog()
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    node = GenerateNode(autostart=autostart)
    try:
        if autostart:
            configured = unless_stopped(node.trigger_configure, stop)
            if configured is None:
                exit_while_configuring(node)
            if configured != TransitionCallbackReturn.SUCCESS:
                node.get_logger().error("configure failed; see above")
                return 1
            node.trigger_activate()
        else:
            node.get_logger().info("unconfigured: waiting for a lifecycle manager to configure and activate")
        # one executor thread waits with each request the node holds (its slots + serve.queue_limit) and a
        # few answer "busy", cancel goals and publish diagnostics while all those wait
        held = node.get_parameter("graphs.batch_slots").value + node.get_parameter("serve.queue_limit").value
        executor = MultiThreadedExecutor(num_threads=held + 4)
        executor.add_node(node)
        try:
            while not stop.is_set() and rclpy.ok():
                executor.spin_once(timeout_sec=0.1)
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        if node.configuring:  # a lifecycle manager's configure is still running in an executor thread
            exit_while_configuring(node)
        node.get_logger().info("shutting down")
        node.stop_generation(timeout=0.5)   # answers every waiting call, so no thread stays blocked
        flush_until = time.monotonic() + 0.2  # deliver those answers (action results need spinning)
        while time.monotonic() < flush_until:
            executor.spin_once(timeout_sec=0.05)
        executor.shutdown(timeout_sec=0.3)
    finally:
        node.exiting = True
        if node.state_name() in ("unconfigured", "inactive", "active"):  # finalized (ros2 lifecycle set ...
            try:                                                           # shutdown) has nothing left to free
                node.trigger_shutdown()
            except Exception as err:  # a transition failed half-way: leave_graph still takes the node down
                node.get_logger().warning(f"lifecycle shutdown: {err}")
        leave_graph(node)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`generate_server` (ros2 run spec_edge generate_server [--no-autostart] --ros-args ...)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="generate_server", description=__doc__.splitlines()[0])
    parser.add_argument("--no-autostart", action="store_true",
                        help="stay unconfigured until a lifecycle manager configures and activates")
    args, ros_args = parser.parse_known_args(argv)
    exit_process(run(ros_args, autostart=not args.no_autostart))


def serve_main(argv: list[str] | None = None) -> int:
    """`spec-edge serve [--params FILE]`: the node without ros2 run / launch.

    Returns only for bad arguments; once the node ran, the process ends in exit_process()."""
    parser = argparse.ArgumentParser(prog="spec-edge serve",
                                     description="Run the spec_edge ROS 2 node (/generate service and action).")
    parser.add_argument("--params", metavar="FILE",
                        help="ROS 2 parameters file (/**: ros__parameters: ...), e.g. config/<profile>.yaml")
    parser.add_argument("--namespace", default="", help="ROS namespace for the node and its endpoints")
    parser.add_argument("--no-autostart", action="store_true",
                        help="stay unconfigured until a lifecycle manager configures and activates")
    args, extra = parser.parse_known_args(argv)
    ros_args: list[str] = []
    if args.params:
        try:
            cfgmod.load(args.params)  # unknown keys and bad values fail here, with the file named
        except cfgmod.ConfigError as err:
            print(f"spec-edge serve: {err}", file=sys.stderr)
            return 2
        ros_args += ["--params-file", args.params]
    if args.namespace:
        ros_args += ["-r", f"__ns:={args.namespace if args.namespace.startswith('/') else '/' + args.namespace}"]
    if extra and extra[0] == "--ros-args":
        extra = extra[1:]
    ros_args = ["--ros-args", *ros_args, *extra] if (ros_args or extra) else []
    exit_process(run(ros_args, autostart=not args.no_autostart))


if __name__ == "__main__":
    sys.exit(main())
