"""The ROS 2 node: parameters -> Config, requests -> Engine.generate, results -> responses.

One lifecycle node ("spec_edge", executable `generate_server`) owns one Engine:

- configure: parameters (declared from spec_edge.config's defaults, one per key) -> Config ->
  Engine.from_config (graphs load/export once); cleanup frees the engine again.
- activate / deactivate: the `generate` service (spec_edge_interfaces/srv/Generate) and the
  `generate` action (spec_edge_interfaces/action/Generate, streaming text deltas as feedback)
  serve, or refuse with a message. Both feed one FIFO queue served by one worker thread; a request arriving while
  serve.queue_limit requests wait is answered "busy" at once; a request older than
  serve.request_timeout_s ends with finish_reason "error". A request that starts with more than
  serve.speculate_max_queue requests queued (itself included; 0 = never) runs target-only: its
  stats carry queued_at_start and speculation_off_reason, /diagnostics counts speculation_off.
- `/diagnostics` (diagnostic_msgs/DiagnosticArray) every serve.diagnostics_period_s.

Everything the node knows about generation comes from the Engine; it only translates.
"""
from __future__ import annotations

import argparse
import array
import collections
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

from spec_edge import config as cfgmod

NODE_NAME = "spec_edge"
SERVICE_NAME = "generate"   # relative: /generate, or /<namespace>/generate
ACTION_NAME = "generate"
REFUSED = ""               # finish_reason of a request that never ran (bad request, busy)
SHUTTING_DOWN = "the node is shutting down; retry on its successor"
# History depth of the generate endpoints (service requests/responses, action services, feedback).
# ROS's default of 10 drops requests when more than 10 arrive at once (they are taken only as
# executor threads free up) and drops feedback deltas a slow client has not read yet.
QOS_DEPTH = 256


# ---------------------------------------------------------------------------------------------
# Translation between ROS messages and the engine's request/result (no rclpy needed here)


def _optional(values: Any) -> Any:
    """A bounded `T[<=1]` field -> its value, or None when empty (node default)."""
    return values[0] if len(values) else None


def check_decoded(name: str, text: str) -> None:
    """Refuse text that arrived as broken UTF-8: rclpy decodes a string field with
    errors="replace", so undecodable bytes reach us as U+FFFD. (Control characters and the rest
    are the engine's to check.)"""
    from spec_edge.runtime.engine import RequestError
    at = text.find("\ufffd")
    if at >= 0:
        raise RequestError(f"{name} is not valid UTF-8 (undecodable bytes at character {at}): "
                           "send UTF-8 text")


def to_engine_request(msg: Any):
    """A Generate service request or action goal -> engine.GenerateRequest (RequestError if bad)."""
    from spec_edge.runtime.engine import GenerateRequest
    check_decoded("prompt", msg.prompt)
    check_decoded("system_prompt", msg.system_prompt)
    for i, m in enumerate(msg.messages):
        check_decoded(f"messages[{i}]", m.role + m.content)
    for i, stop in enumerate(msg.stop):
        check_decoded(f"stop[{i}]", stop)
    temperature = _optional(msg.temperature)
    top_p = _optional(msg.top_p)
    return GenerateRequest(
        prompt=msg.prompt,
        messages=tuple((m.role, m.content) for m in msg.messages),
        system_prompt=msg.system_prompt,
        max_new_tokens=_optional(msg.max_new_tokens),
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=_optional(msg.top_k),
        seed=_optional(msg.seed),
        stop=tuple(msg.stop),
        speculate=bool(msg.speculate),
        drafter=msg.drafter or None,
        k=_optional(msg.k),
    )


@dataclass
class Outcome:
    """What the node answers: the fields of the service response / action result."""
    success: bool
    message: str = ""
    text: str = ""
    num_tokens: int = 0
    finish_reason: str = REFUSED
    stats: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def refused(cls, message: str) -> "Outcome":
        return cls(success=False, message=message)


def fill_response(resp: Any, outcome: Outcome) -> Any:
    """Write an Outcome into a Generate response / action result message."""
    resp.success = outcome.success
    resp.message = outcome.message
    resp.text = outcome.text
    resp.num_tokens = outcome.num_tokens
    resp.finish_reason = outcome.finish_reason
    for name in resp.stats.get_fields_and_field_types():
        if name in outcome.stats and outcome.stats[name] is not None:
            current = getattr(resp.stats, name)
            value = outcome.stats[name]
            if isinstance(current, str):
                value = str(value)
            elif isinstance(current, int):
                value = int(value)
            else:
                value = float(value)
                if not math.isfinite(value):
                    value = 0.0
            setattr(resp.stats, name, value)
    return resp


def response_to_dict(resp: Any) -> dict[str, Any]:
    """A Generate response / action result -> plain dict (the `spec-edge ask --json` object)."""
    out = {name: getattr(resp, name) for name in resp.get_fields_and_field_types() if name != "stats"}
    out["stats"] = {name: getattr(resp.stats, name) for name in resp.stats.get_fields_and_field_types()}
    return out


# ---------------------------------------------------------------------------------------------
# The queue in front of the engine (no rclpy here either)


@dataclass
class Job:
    request: Any                                    # engine.GenerateRequest
    on_text: Callable[[str, int], None] | None = None
    cancel_requested: Callable[[], bool] = lambda: False
    deadline: float = math.inf                      # time.monotonic() past which it ends as error
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    timed_out: bool = False
    queued_at_start: int = 0                        # requests queued as it started, itself included

    def finish(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.done.set()


class Worker:
    """One thread that runs queued jobs through the engine, first in first out."""

    def __init__(self, engine: Any, cfg: cfgmod.Config, logger: Any):
        self.engine = engine
        self.cfg = cfg
        self.logger = logger
        self._lock = threading.Lock()
        self._waiting: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self.current: Job | None = None
        self.served = 0
        self.refused_busy = 0
        self.speculation_off = 0  # requests run target-only by serve.speculate_max_queue
        self.last_stats: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="spec_edge-worker", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting (not counting the one running)."""
        return len(self._waiting)

    def submit(self, job: Job) -> bool:
        """Queue a job; False (and the job answered "busy") when serve.queue_limit are waiting."""
        limit = self.cfg.serve.queue_limit
        with self._lock:
            if self._stopping:
                job.finish(Outcome.refused(SHUTTING_DOWN))
                return False
            if len(self._waiting) >= limit:
                self.refused_busy += 1
                job.finish(Outcome.refused(
                    f"busy: {len(self._waiting)} requests already wait (serve.queue_limit={limit}); "
                    "retry later"))
                return False
            job.deadline = time.monotonic() + self.cfg.serve.request_timeout_s
            self._waiting.append(job)
            self._wake.notify()
        return True

    def stop(self, timeout: float) -> None:
        """Refuse what waits, cancel what runs (between speculative steps), join."""
        with self._lock:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._wake.notify_all()
        for job in waiting:
            job.finish(Outcome.refused(SHUTTING_DOWN))
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                job.queued_at_start = len(self._waiting) + 1
                self.current = job
            try:
                job.finish(self._generate(job))
            finally:
                with self._lock:
                    self.current = None

    def _cancel_reason(self, job: Job) -> str | None:
        if self._stopping or job.cancel_requested():
            return "cancelled"
        if time.monotonic() > job.deadline:
            job.timed_out = True
            return "error"
        return None

    def _generate(self, job: Job) -> Outcome:
        from spec_edge.runtime.engine import RequestError
        early = self._cancel_reason(job)
        if early == "cancelled":
            return Outcome(success=True, finish_reason="cancelled")
        if early is not None:
            return self._timeout_outcome(job, None)
        try:
            result = self.engine.generate(job.request, on_text=job.on_text,
                                          cancel=lambda: self._cancel_reason(job), queued=job.queued_at_start)
        except RequestError as err:
            return Outcome.refused(str(err))
        except Exception as err:  # the engine failed on a valid request: report it, keep serving
            self.logger.error(f"generation failed: {err}\n{traceback.format_exc()}")
            return Outcome(success=False, message=f"generation failed: {type(err).__name__}: {err}",
                           finish_reason="error")
        self.served += 1
        if result.speculation_off_reason:
            self.speculation_off += 1
            self.logger.info(f"speculation off: {result.speculation_off_reason}")
        stats = result_stats(result)
        self.last_stats = stats
        if job.timed_out:
            return self._timeout_outcome(job, result)
        outcome = Outcome(success=True, message=getattr(result, "message", ""), text=result.text,
                          num_tokens=len(result.token_ids), finish_reason=result.finish_reason, stats=stats)
        if self._stopping and result.finish_reason == "cancelled":
            outcome.success = False
            outcome.message = "the node shut down during the generation; retry on its successor"
        return outcome

    def _timeout_outcome(self, job: Job, result: Any) -> Outcome:
        limit = self.cfg.serve.request_timeout_s
        return Outcome(
            success=False, finish_reason="error",
            message=(f"timed out: the request was not finished within serve.request_timeout_s={limit} s "
                     "(queue wait included); ask for fewer max_new_tokens or raise the timeout"),
            text=result.text if result else "", num_tokens=len(result.token_ids) if result else 0,
            stats=result_stats(result) if result else {})


def result_stats(result: Any) -> dict[str, Any]:
    """The GenerationStats fields of an engine result: the loop's stats plus the queue's decision."""
    stats = result.stats.as_dict()
    stats.update(queued_at_start=result.queued_at_start, speculation_off_reason=result.speculation_off_reason)
    return stats


def endpoint_qos():
    """The QoS of the generate service, the action's services and its feedback (both sides)."""
    import copy
    from rclpy.qos import qos_profile_services_default
    qos = copy.copy(qos_profile_services_default)
    qos.depth = QOS_DEPTH
    return qos


def action_qos_kwargs(feedback_key: str) -> dict[str, Any]:
    qos = endpoint_qos()
    return {"goal_service_qos_profile": qos, "result_service_qos_profile": qos,
            "cancel_service_qos_profile": qos, feedback_key: qos}


# ---------------------------------------------------------------------------------------------
# Parameters


def _param_value(value: Any) -> Any:
    """A ROS parameter value -> the plain Python value spec_edge.config expects."""
    if isinstance(value, (array.array, tuple)):
        return list(value)
    return value


# ---------------------------------------------------------------------------------------------
# The node (rclpy imported lazily so that the module imports without ROS installed)


def make_node_class():
    from rclpy.action import ActionServer, CancelResponse, GoalResponse
    from rclpy.callback_groups import ReentrantCallbackGroup
    from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
    from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
    from spec_edge_interfaces.action import Generate as GenerateAction
    from spec_edge_interfaces.srv import Generate as GenerateSrv

    class GenerateNode(LifecycleNode):
        """spec_edge's lifecycle node; see the module docstring."""

        def __init__(self, **kwargs):
            super().__init__(NODE_NAME, **kwargs)
            self._group = ReentrantCallbackGroup()
            self.cfg: cfgmod.Config | None = None
            self.engine: Any = None
            self.worker: Worker | None = None
            self._info: dict[str, Any] = {}
            self._active = False
            self._diag_timer = None
            dynamic = ParameterDescriptor(dynamic_typing=True)
            for name, default in cfgmod.to_params(cfgmod.Config()).items():
                self.declare_parameter(name, default, dynamic)
            self.add_on_set_parameters_callback(self._check_parameters)
            self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
            # The endpoints live as long as the node and refuse requests unless it is active:
            # destroying an action server while a multi-threaded executor waits on it crashes rclpy.
            self._service = self.create_service(GenerateSrv, SERVICE_NAME, self._on_service,
                                                qos_profile=endpoint_qos(), callback_group=self._group)
            self._action = ActionServer(
                self, GenerateAction, ACTION_NAME, execute_callback=self._on_goal_execute,
                goal_callback=lambda goal: GoalResponse.ACCEPT,
                cancel_callback=lambda handle: CancelResponse.ACCEPT,
                callback_group=self._group, **action_qos_kwargs("feedback_pub_qos_profile"))

        # -- parameters -------------------------------------------------------------------------

        def _current_params(self) -> dict[str, Any]:
            names = cfgmod.to_params(cfgmod.Config())
            return {name: _param_value(self.get_parameter(name).value) for name in names}

        def _check_parameters(self, params: list) -> Any:
            merged = self._current_params()
            merged.update({p.name: _param_value(p.value) for p in params})
            try:
                cfgmod.from_params(merged)
            except cfgmod.ConfigError as err:
                return SetParametersResult(successful=False, reason=str(err))
            return SetParametersResult(successful=True)  # used from the next configure on

        # -- lifecycle --------------------------------------------------------------------------

        def on_configure(self, state):
            try:
                self.cfg = cfgmod.from_params(self._current_params())
            except cfgmod.ConfigError as err:
                self.get_logger().error(f"configure: {err}")
                return TransitionCallbackReturn.FAILURE
            self.get_logger().info(
                f"loading engine: target={self.cfg.model.target} backend={self.cfg.runtime.backend} "
                f"drafter={self.cfg.speculative.drafter} k={self.cfg.speculative.k}")
            started = time.monotonic()
            try:
                from spec_edge.runtime.engine import Engine
                self.engine = Engine.from_config(self.cfg, progress=self.get_logger().info)
                self._info = dict(self.engine.info())
            except Exception as err:  # a missing model, a refused memory plan, a failed build
                self.get_logger().error(f"configure: engine did not load: {err}")
                self.engine = None
                return TransitionCallbackReturn.FAILURE
            self.worker = Worker(self.engine, self.cfg, self.get_logger())
            self._diag_timer = self.create_timer(self.cfg.serve.diagnostics_period_s,
                                                 self.publish_diagnostics, callback_group=self._group)
            self.get_logger().info(f"engine loaded in {time.monotonic() - started:.1f} s: {self._info}")
            return TransitionCallbackReturn.SUCCESS

        def on_activate(self, state):
            self._active = True
            self.get_logger().info(f"serving {self.resolve_service_name(SERVICE_NAME)} (service and action)")
            return super().on_activate(state)

        def on_deactivate(self, state):
            self._active = False
            return super().on_deactivate(state)

        def on_cleanup(self, state):
            self._unload()
            return TransitionCallbackReturn.SUCCESS

        def on_shutdown(self, state):
            self._active = False
            self._unload()
            return TransitionCallbackReturn.SUCCESS

        def _unload(self, timeout: float = 1.0):
            if self._diag_timer is not None:
                self.destroy_timer(self._diag_timer)
                self._diag_timer = None
            if self.worker is not None:
                self.worker.stop(timeout)
                self.worker = None
            if self.engine is not None:
                self.engine.close()
                self.engine = None
                self.get_logger().info("engine freed")

        def state_name(self) -> str:
            return self._state_machine.current_state[1]  # rclpy has no public getter

        def stop_generation(self, timeout: float) -> None:
            """For signal handling: refuse waiting requests, cancel the running one, join."""
            if self.worker is not None:
                self.worker.stop(timeout)

        # -- endpoints ----------------------------------------------------------------------------

        def _run_job(self, msg: Any, **job_kwargs) -> Outcome:
            worker, cfg, engine = self.worker, self.cfg, self.engine
            if not self._active or worker is None or cfg is None or engine is None:
                state = self.state_name()
                return Outcome.refused(f"the node is {state}, not active: it serves once a lifecycle "
                                       "manager configures and activates it")
            from spec_edge.runtime.engine import RequestError
            try:
                request = to_engine_request(msg)
                # refused at once, not after waiting in the queue (and without taking a slot of it)
                engine.validate(request)
            except RequestError as err:
                return Outcome.refused(str(err))
            job = Job(request, **job_kwargs)
            if worker.submit(job):
                # the worker always finishes a job; the margin only guards against a hung engine
                if not job.done.wait(cfg.serve.request_timeout_s + 30.0):
                    return Outcome(success=False, finish_reason="error",
                                   message="the engine did not return; the node needs a restart")
            return job.outcome

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
            worker, cfg = self.worker, self.cfg
            status = DiagnosticStatus(name=f"{self.get_fully_qualified_name()}: generator",
                                      hardware_id=str(self._info.get("backend", "")))
            values: dict[str, Any] = {"state": self.state_name()}
            if worker is None or cfg is None:
                status.level, status.message = DiagnosticStatus.WARN, "engine not loaded"
            else:
                depth = worker.queue_depth
                values.update(self._info)
                values.update(queue_depth=depth, queue_limit=cfg.serve.queue_limit,
                              running=worker.current is not None, served=worker.served,
                              refused_busy=worker.refused_busy,
                              speculate_max_queue=cfg.serve.speculate_max_queue,
                              speculation_off=worker.speculation_off)
                values.update({f"last_{k}": v for k, v in worker.last_stats.items()
                               if isinstance(v, (int, float, str))})
                if depth >= cfg.serve.queue_limit:
                    status.level, status.message = DiagnosticStatus.WARN, "queue full"
                else:
                    status.level, status.message = DiagnosticStatus.OK, "ready"
            status.values = [KeyValue(key=str(k), value=_diag_str(v)) for k, v in values.items()]
            msg = DiagnosticArray(status=[status])
            msg.header.stamp = self.get_clock().now().to_msg()
            self._diag_pub.publish(msg)

    return GenerateNode


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
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.signals import SignalHandlerOptions

    rclpy.init(args=["spec_edge", *ros_args], signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    node = make_node_class()()
    try:
        if autostart:
            if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
                node.get_logger().error("configure failed; see above")
                return 1
            node.trigger_activate()
        else:
            node.get_logger().info("unconfigured: waiting for a lifecycle manager to configure and activate")
        # one thread runs each request (the queue plus the one generating) and a few answer
        # "busy", cancel goals and publish diagnostics while all those wait
        limit = node.cfg.serve.queue_limit if node.cfg else cfgmod.ServeSection().queue_limit
        executor = MultiThreadedExecutor(num_threads=limit + 4)
        executor.add_node(node)
        try:
            while not stop.is_set() and rclpy.ok():
                executor.spin_once(timeout_sec=0.1)
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        node.get_logger().info("shutting down")
        node.stop_generation(timeout=1.0)   # answers every waiting call, so no thread stays blocked
        flush_until = time.monotonic() + 0.2  # deliver those answers (action results need spinning)
        while time.monotonic() < flush_until:
            executor.spin_once(timeout_sec=0.05)
        executor.shutdown(timeout_sec=0.5)
    finally:
        try:
            node.trigger_shutdown()
        except Exception as err:  # already finalized or in an error state: nothing left to free
            node.get_logger().warning(f"lifecycle shutdown: {err}")
        node.destroy_node()
        rclpy.try_shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def exit_process(status: int) -> NoReturn:
    """End the process once run() has shut the node down and finalized rclpy.

    Everything ROS is released by then; what is left is the interpreter's teardown of torch and
    ONNX Runtime objects, which takes a second or more with torch loaded. Skipping it keeps the
    exit within the 2 s a robot's launch system allows after SIGINT/SIGTERM.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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
