"""How the node's process ends: within 2 s of SIGINT / SIGTERM in every state (a watchdog enforces
it), leaving the ROS graph at once, without the interpreter's slow teardown. The node (spec_edge.ros2.node) calls these; they know nothing of its class."""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn


def unless_stopped(call: Callable[[], Any], stop: threading.Event) -> Any:
    """call() in a thread while this (the main) thread watches `stop`: what call returned, or None
    when a signal came first. A first start's configure exports for minutes in code that Python's
    signal handlers cannot interrupt; the process must still end within 2 s of SIGINT / SIGTERM."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # handed to the main thread, raised there
            box["error"] = err

    thread = threading.Thread(target=target, name="configure", daemon=True)
    thread.start()
    while thread.is_alive():
        if stop.wait(0.05):
            return None
    if "error" in box:
        raise box["error"]
    return box["value"]


# Signal -> process gone, at most (a launch system allows 2 s): what the teardown has not finished by
# then is cut short by the watchdog. The rest of the 2 s is for what comes around it on a loaded machine: the
# signal handler runs once the main thread is back in Python (up to an executor wait of 0.1 s), and the kernel's
# teardown of the process's memory after os._exit.
EXIT_WITHIN_S = 1.5


def start_watchdog(seconds: float = EXIT_WITHIN_S) -> None:
    """End the process `seconds` from now whatever the main thread is doing (a teardown that hangs)."""
    timer = threading.Timer(seconds, lambda: exit_process(0))
    timer.daemon = True
    timer.start()


def leave_graph(node) -> None:
    """Destroy the node and finalize rclpy's context, so the DDS participant is deleted and announces
    it: other processes drop the node from the graph at once (os._exit alone leaves it listed until
    their discovery lease runs out, 15-20 s with Fast DDS). Any state; errors are logged, not raised."""
    import rclpy
    from rclpy.utilities import get_default_context

    try:
        node.destroy_node()
    except Exception as err:  # a half-torn-down node: the context below still takes the participant down
        print(f"[spec_edge] destroy_node: {err}", file=sys.stderr)
    rclpy.try_shutdown()
    get_default_context().destroy()


def exit_while_configuring(node) -> NoReturn:
    """Signalled during configure: end now. Nothing is lost: an export writes into a temporary folder
    that becomes the artifact only once complete (the next start removes it and exports again)."""
    node.get_logger().warning("stopped while configuring (loading or exporting the graphs): exiting now; "
                              "an unfinished export is discarded and redone at the next start")
    leave_graph(node)
    exit_process(0)


def exit_process(status: int) -> NoReturn:
    """End the process once run() has shut the node down and finalized rclpy (leave_graph).

    Everything ROS is released by then; what is left is the interpreter's teardown of torch and
    ONNX Runtime objects, which takes a second or more with torch loaded. Skipping it keeps the
    exit within the 2 s a robot's launch system allows after SIGINT/SIGTERM.
    """
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe (the launch process that read it is gone): exit all the same
        pass
    os._exit(status)
